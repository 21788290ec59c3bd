# Written by notebooks/12_composed_parallelism.ipynb - edit it there; running the notebook rewrites this file.
"""Bytes of one HSDP training step on each mesh dimension: predicted from the parameters' shapes, then counted.

    torchrun --nproc-per-node=4 scripts/hsdp_bytes.py       # ("replicate", "shard") = 2 x 2

The model and its sharding are train_2d.py's with --layout hsdp (fully_shard on a 2-D mesh). What FSDP2
does on each dimension in one forward and backward:
- "shard": each unit's parameters all-gathered before its forward (every block, and the root: embeddings,
  ln_f, head), the blocks gathered again before their backward (the root keeps its gathered parameters:
  fully_shard's reshard_after_forward is False for the root), each unit's gradients reduce-scattered;
- "replicate": each unit's gradient shard all-reduced across the replicas.
FSDP2 pads each parameter's first dimension to a multiple of the shard group's size, and the prediction
counts the padding too. The counter (course.comm_count) records the process group of every collective.
"""
import argparse
import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from course import flag
from course.args import JobParser, output_dir, positive_int
from course.comm_count import CollectiveCounter, bytes_sent
from course.errors import reported_once
from course.gpt import GPT, GPTConfig, loss_fn
from course.lm_data import DataError, load_lm_data
from course.rundir import claim_run_dir
from train_2d import pick_device, shard_model  # the same model and plan as train_2d.py


def padded(shape, n):
    """Elements of a parameter of this (whole) shape once FSDP2 pads its first dimension to a multiple of n."""
    rows = -(-shape[0] // n) * n
    return rows * (torch.Size(shape).numel() // shape[0])


def predict(units, shard, replicate, bytes_per=4):
    """{dimension: {phase: {kind: [calls, bytes]}}} for one forward and backward; ``units``: the parameter
    shapes of each fully_shard unit, the blocks first and the root last. Bytes as the counter counts them:
    an all-gather's whole output, a reduce-scatter's whole input, an all-reduce's tensor."""
    sizes = [sum(padded(s, shard) for s in unit) * bytes_per for unit in units]
    blocks, every = sizes[:-1], sizes
    return {"shard": {"forward": {"all-gather": [len(every), sum(every)]},
                      "backward": {"all-gather": [len(blocks), sum(blocks)],
                                   "reduce-scatter": [len(every), sum(every)]}},
            "replicate": {"backward": {"all-reduce": [len(every), sum(every) // shard]}} if replicate > 1 else {}}


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=positive_int, default=2, help="size of 'replicate'; 'shard' gets the rest")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--run-dir", type=output_dir, default="runs/hsdp_bytes")
    args = parser.parse_args()
    world = parser.world_size()  # checked before the process group starts: one error line
    if world % args.dp:
        parser.error(f"argument --dp: {args.dp} rows do not divide the {world} processes into a grid")
    if args.batch_size % world:
        parser.error(f"argument --batch-size: {args.batch_size} does not split into {world} equal slices, one per "
                     "process")
    try:
        data = load_lm_data(batch_size=args.batch_size)
    except DataError as error:
        parser.error(f"argument {error.flag}: {error}")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    rank = int(os.environ["RANK"])  # rank 0 writes --run-dir, so it claims it (staged: the launcher does)
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    dist.init_process_group(dist.get_default_backend_for_device(device.type))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = ("replicate", "shard")
    mesh = init_device_mesh(device.type, (args.dp, world_size // args.dp), mesh_dim_names=names)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size)).to(device)
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    units = [[tuple(p.shape) for p in b.parameters()] for b in model.blocks]
    units.append([tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks])  # the root's own
    args.layout, args.sequence_parallel = "hsdp", False
    model = shard_model(model, mesh, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = (t.to(device) for t in data.batch("train", 0, args.batch_size, 0))
    rows = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    counter = CollectiveCounter(world_size)
    for step in range(2):  # the first step runs FSDP2's lazy initialisation; the second is counted
        optimizer.zero_grad(set_to_none=True)
        with counter.phase("forward") if step else nullcontext():
            loss = loss_fn(model(x[rows]), y[rows])
        with counter.phase("backward") if step else nullcontext():
            loss.backward()
        optimizer.step()
    groups = {name: mesh.get_group(name).group_name for name in names}
    counted = {name: counter.summary(group=g) for name, g in groups.items()}
    predicted = predict(units, shard=mesh.size(1), replicate=mesh.size(0))
    sizes = {name: mesh.size(i) for i, name in enumerate(names)}
    sent = {name: sum(bytes_sent(kinds, sizes[name]) for kinds in counted[name].values()) for name in names}
    if rank == 0:
        metrics = {"script": "hsdp_bytes", "world_size": world_size, "mesh": sizes, "groups": groups,
                   "params": sum(torch.Size(s).numel() for unit in units for s in unit),
                   "counted": counted, "predicted": predicted, "sent_per_rank": sent,
                   "other_groups": len([g for g in counter.groups if g not in groups.values()])}
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(args.run_dir) / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2))
        os.replace(tmp, Path(args.run_dir) / "metrics.json")
        print(f"hsdp_bytes: mesh {sizes}, one step counted on rank 0 ({device}, {dist.get_backend()})", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
