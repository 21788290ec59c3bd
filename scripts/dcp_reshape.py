# Written by notebooks/12_composed_parallelism.ipynb - edit it there; running the notebook rewrites this file.
"""Save a distributed checkpoint (DCP) on one mesh shape and continue from it on another.

    torchrun --nproc-per-node=4 scripts/dcp_reshape.py --save ckpt            # 2 x 2: train, save, train on
    torchrun --nproc-per-node=2 scripts/dcp_reshape.py --load ckpt --dp 1     # 1 x 2: load, train on
    torchrun --nproc-per-node=1 scripts/dcp_reshape.py --load ckpt --dp 1     # one process: load, train on

The model is train_2d.py's (FSDP2 over "dp" x TP over "tp"). Each rank writes only its own shards of the
model and the optimizer, with a description of where each piece sits in the whole tensor; a loading rank
asks for the pieces of its own (new) shards, so the checkpoint does not depend on the mesh that wrote it.
Every shape then continues with the same steps: their losses are the checkpoint's proof.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from course import flag
from course.args import JobParser, output_dir, positive_float, positive_int
from course.dcp_check import WeightsOnlyPlanner, load_failure, problem, unverified, write_manifest
from course.errors import reported_once
from course.gpt import GPT, GPTConfig, loss_fn
from course.lm_data import DataError, load_lm_data
from course.rundir import claim_run_dir
from train_2d import loss_context, pick_device, shard_model  # the same model and plan as train_2d.py


def train(model, optimizer, data, steps, args, mesh, device):
    """Steps `steps` (a range) of train_2d.py's loop; returns the whole batch's loss at each."""
    dp_rank, dp = mesh.get_local_rank("dp"), mesh.size(0)
    losses = []
    for step in steps:
        x, y = (t.to(device) for t in data.batch("train", step, args.batch_size, 0))
        rows = slice(dp_rank * args.batch_size // dp, (dp_rank + 1) * args.batch_size // dp)
        with loss_context(args):
            loss = loss_fn(model(x[rows]), y[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        whole = torch.tensor(loss.item(), dtype=torch.float64, device=device)
        dist.all_reduce(whole, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        losses.append(whole.item())
    return losses


def parse_args():
    """The flags, the data and the checkpoint to load, checked before the process group: one error line."""
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", type=output_dir, help="train --steps, save the checkpoint here, then train --steps more")
    parser.add_argument("--load", help="load the checkpoint from here, then train --steps more")
    parser.add_argument("--dp", type=positive_int, default=2, help="size of 'dp'; 'tp' gets the rest of the ranks")
    parser.add_argument("--steps", type=positive_int, default=4)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--run-dir", type=output_dir, default="runs/dcp_reshape")
    args = parser.parse_args()
    if bool(args.save) == bool(args.load):
        parser.error("give exactly one of --save and --load")
    world, heads = parser.world_size(), GPTConfig.n_head
    if world % args.dp:
        parser.error(f"argument --dp: {args.dp} rows do not divide the {world} processes into a grid")
    if heads % (world // args.dp):
        parser.error(f"argument --dp: {args.dp} leaves {world // args.dp} processes per 'tp' group, and the model's "
                     f"{heads} heads do not split over them")
    if args.batch_size % args.dp:
        parser.error(f"argument --batch-size: {args.batch_size} does not split into {args.dp} equal slices, one per "
                     "'dp' group")
    if args.load and (why := problem(args.load)) is not None:
        parser.error(f"argument --load: {why}")
    try:
        data = load_lm_data(batch_size=args.batch_size)
    except DataError as error:
        parser.error(f"argument {error.flag}: {error}")
    return args, data


def main():
    args, data = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    rank = int(os.environ["RANK"])  # rank 0 writes --run-dir, so it claims it (staged: the launcher does)
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    dist.init_process_group(dist.get_default_backend_for_device(device.type))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (args.dp, world_size // args.dp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size)
    args.layout, args.sequence_parallel = "2d", False  # train_2d.py's defaults
    model = shard_model(GPT(cfg).to(device), mesh, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    before, steps = [], args.steps
    if args.save:
        before = train(model, optimizer, data, range(steps), args, mesh, device)
        model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: this rank's shards + their places
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.save)  # every rank writes its part
        dist.barrier()  # every piece on disk before rank 0 takes their checksums
        if rank == 0:
            write_manifest(args.save)  # sha256.json: a piece damaged later is refused, not loaded
    else:
        model_state, optim_state = get_state_dict(model, optimizer)  # the shapes this mesh wants
        state = {"model": model_state, "optim": optim_state}
        if rank == 0 and (note := unverified(args.load)) is not None:
            print(note, flush=True)
        try:
            # each rank reads the pieces of its own shards; the items that are not tensors (the optimizer's
            # param_groups) with torch's weights-only unpickler: a checkpoint holds data, never code
            dcp.load(state, checkpoint_id=args.load, planner=WeightsOnlyPlanner())
        except dcp.CheckpointException as error:  # raised on every rank alike (DCP gathers each rank's failure)
            if rank == 0:
                print(f"error: {load_failure(args.load, error)}", file=sys.stderr, flush=True)
            dist.barrier()  # every rank got it; all leave together: gloo's exit race, notebook 03
            dist.destroy_process_group()
            raise SystemExit(2) from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after = train(model, optimizer, data, range(steps, 2 * steps), args, mesh, device)
    if rank == 0:
        metrics = {"script": "dcp_reshape", "mode": "save" if args.save else "load", "world_size": world_size,
                   "mesh": {"dp": mesh.size(0), "tp": mesh.size(1)}, "losses_before": before, "losses_after": after,
                   "checkpoint_files": sorted(p.name for p in Path(args.save or args.load).iterdir())}
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(args.run_dir) / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2))
        os.replace(tmp, Path(args.run_dir) / "metrics.json")
        shape = f"{mesh.size(0)} x {mesh.size(1)}"
        print(f"{metrics['mode']} on {shape}: losses after the checkpoint " + ", ".join(f"{v:.6f}" for v in after),
              flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
