# Written by notebooks/12_composed_parallelism.ipynb - edit it there; running the notebook rewrites this file.
"""Train the course's small GPT on a 2-D device mesh: FSDP2 x TP, or HSDP (replicate x shard).

    torchrun --nproc-per-node=4 scripts/train_2d.py                  # ("dp", "tp") = 2 x 2: TP inside, FSDP2 across
    torchrun --nproc-per-node=4 scripts/train_2d.py --layout hsdp    # ("replicate", "shard") = 2 x 2, no TP

train_tp.py with the changes marked "2D step N". Each data-parallel group reads its slice of the same
batch train_lm.py reads (ranks of one TP group read the same slice), so the run equals train_lm.py's.
"""
import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import parallel as tp
from torch.utils.tensorboard import SummaryWriter

from course import flag
from course.args import (
    JobParser,
    check_gpt_size,
    lm_seed,
    output_dir,
    positive_float,
    positive_int,
    writable_file,
)
from course.errors import reported_once
from course.gpt import GPT, GPTConfig, loss_fn
from course.lm_data import DataError, load_lm_data
from course.rundir import claim_run_dir

NAME = Path(__file__).stem
SHOWN = ("blocks.0.mlp.fc.weight", "blocks.0.ln1.weight", "tok_emb.weight")  # 2D step 2: placements recorded


def parse_args():
    """The flags and the data they name, checked here: bad input ends the run with one line, before any work."""
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="a folder of *.txt files instead of the generated arithmetic")
    parser.add_argument("--block-size", type=positive_int, default=64, help="text only: characters per sample")
    parser.add_argument("--steps", type=positive_int, default=1500)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="samples per step")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--n-layer", type=positive_int, default=2)
    parser.add_argument("--n-head", type=positive_int, default=4)
    parser.add_argument("--n-embd", type=positive_int, default=64)
    parser.add_argument("--seed", type=lm_seed, default=0)
    parser.add_argument("--layout", choices=["2d", "hsdp"], default="2d",  # 2D step 1
                        help="2d: FSDP2 over 'dp' x TP over 'tp'; hsdp: replicate x shard, the whole model per group")
    parser.add_argument("--dp", type=positive_int, default=2,
                        help="size of the first mesh dimension ('dp' / 'replicate')")
    parser.add_argument("--sequence-parallel", action="store_true",  # TP step 3
                        help="also split the LayerNorms (and the activations between blocks) by position")
    parser.add_argument("--log-every", type=positive_int, default=100, help="steps between printed losses")
    parser.add_argument("--run-dir", type=output_dir, default=f"runs/{NAME}",
                        help="TensorBoard events and metrics.json")
    parser.add_argument("--save", type=writable_file, default=f"weights/{NAME}.pt",
                        help="the final weights ('' : not saved)")
    args = parser.parse_args()
    if args.n_embd % args.n_head:
        parser.error(f"argument --n-head: {args.n_head} does not divide --n-embd {args.n_embd} "
                     "(each head gets an equal share of the width)")
    world_size = parser.world_size()  # TP step 1: torchrun's processes, each holding a slice of every layer
    if world_size % args.dp:  # 2D step 1: the processes as a grid of --dp rows
        parser.error(f"argument --dp: {args.dp} rows do not divide the {world_size} processes into a grid")
    tp_size = world_size // args.dp if args.layout == "2d" else 1  # 2D step 1: hsdp runs no TP
    if args.sequence_parallel and args.layout != "2d":  # 2D step 1
        parser.error("argument --sequence-parallel: only with --layout 2d (hsdp runs no tensor parallelism)")
    slices = args.dp if args.layout == "2d" else world_size  # 2D step 4: data-parallel slices of the batch
    if args.batch_size % slices:  # 2D step 4
        parser.error(f"argument --batch-size: {args.batch_size} does not split into {slices} equal slices, one "
                     "per data-parallel group")
    if args.n_head % tp_size:  # 2D step 1: whole heads on every rank of a "tp" group
        parser.error(f"argument --n-head: {args.n_head} heads do not split over {tp_size} processes "
                     "(tensor parallelism gives each the same number of whole heads)")
    try:
        data = load_lm_data(args.data_dir, args.block_size, args.batch_size)
    except DataError as error:
        parser.error(f"argument {error.flag}: {error}")
    check_gpt_size(parser, args, data, shards=world_size)  # before any allocation
    if args.sequence_parallel and data.block_size % tp_size:  # 2D step 1: positions split evenly over "tp"
        parser.error(f"argument --sequence-parallel: the {data.block_size} positions of a sample do not split "
                     f"over {tp_size} processes")
    return args, data


def pick_device(local_rank):  # TP step 1: one accelerator per process, if its backend carries it
    """accelerator:local_rank when there is one for every process on this machine, else the CPU (gloo)."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is not None and torch.accelerator.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        backend = dist.get_default_backend_for_device(acc.type)  # nccl for CUDA, xccl for XPU
        if acc.type in dist.Backend.backend_capability.get(backend, ()):  # not MPS: gloo cannot carry it
            return torch.device(acc.type, local_rank)
    return torch.device("cpu")


def tensor_parallel(model, mesh, sequence_parallel):  # TP step 3: the plan, applied from outside the model
    """Split q, k, v and the MLP's fc by output columns, attention's and the MLP's proj by input rows
    (one all-reduce each), the head by vocabulary (loss_parallel). With sequence parallelism the
    LayerNorms and the activations between blocks are split by position (dim 1) instead of replicated."""
    seq = Shard(1) if sequence_parallel else Replicate()
    for block in model.blocks:
        plan = {"attn.q": tp.ColwiseParallel(), "attn.k": tp.ColwiseParallel(), "attn.v": tp.ColwiseParallel(),
                "attn.proj": tp.RowwiseParallel(output_layouts=seq),
                "mlp.fc": tp.ColwiseParallel(), "mlp.proj": tp.RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:  # all-gather the positions going into attention and MLP
            plan |= {"ln1": tp.SequenceParallel(), "ln2": tp.SequenceParallel(),
                     "attn": tp.PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate()),
                     "mlp": tp.PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate())}
        tp.parallelize_module(block, mesh, plan)
    plan = {"head": tp.ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:  # each rank keeps its positions of the embeddings' output (no communication
        # forward; the gradient is all-gathered in backward)
        plan |= {"blocks.0": tp.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=seq,
                                                   use_local_output=True),
                 "ln_f": tp.SequenceParallel()}
    return tp.parallelize_module(model, mesh, plan)


def shard_model(model, mesh, args):  # 2D step 2: TP inside each "tp" group, then FSDP2 across "dp"
    """2d: the TP plan on mesh["tp"], then every block and the root sharded over mesh["dp"].
    hsdp: fully_shard on the 2-D mesh itself: shards within each "shard" group, replicas across "replicate"."""
    if args.layout == "2d":
        model = tensor_parallel(model, mesh["tp"], args.sequence_parallel)
        fsdp_mesh = mesh["dp"]
    else:
        fsdp_mesh = mesh  # a 2-D mesh: fully_shard makes it HSDP (all-reduce across dim 0, reduce-scatter on dim 1)
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return model


def loss_context(args):  # 2D step 3: the vocabulary-sharded loss only when the head is split by TP
    return tp.loss_parallel() if args.layout == "2d" else contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, data, device, args):
    """(loss, exact-answer accuracy) on the validation split, in one batch."""
    model.eval()
    x, y = (t.to(device) for t in data.split("val"))
    logits = model(x)
    with loss_context(args):  # 2D step 3
        loss = loss_fn(logits, y).item()
    whole = logits.full_tensor() if isinstance(logits, DTensor) else logits  # 2D step 3
    right, total = data.accuracy(whole, y)
    model.train()
    return loss, right / total


def save_json(obj, path):
    """Write to a temporary file, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def full_state_dict(model):  # TP step 5: every rank joins the gathers; rank 0 saves the whole tensors
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def main():
    args, data = parse_args()
    rank = int(os.environ["RANK"])  # TP step 5: rank 0 writes --run-dir, so it claims it
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    local_rank = int(os.environ["LOCAL_RANK"])  # TP step 1: set by torchrun for each process
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    dist.init_process_group(dist.get_default_backend_for_device(device.type))  # TP step 1
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = ("dp", "tp") if args.layout == "2d" else ("replicate", "shard")  # 2D step 1: a named 2-D mesh
    mesh = init_device_mesh(device.type, (args.dp, world_size // args.dp), mesh_dim_names=names)
    dp_group = mesh.get_group("dp") if args.layout == "2d" else None  # 2D step 4: the ranks reading other slices
    dp_rank, dp_size = (mesh.get_local_rank("dp"), args.dp) if args.layout == "2d" else (rank, world_size)
    torch.manual_seed(args.seed)  # the same initial weights on every run
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg).to(device)
    model = shard_model(model, mesh, args)  # 2D step 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    writer = SummaryWriter(args.run_dir) if rank == 0 else None  # TP step 5: rank 0 writes
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    placements = {name: {"placements": [str(pl) for pl in p.placements],  # 2D step 2: one per mesh dimension
                         "mesh": list(p.device_mesh.mesh_dim_names), "shape": list(p.shape),  # 2D step 2
                         "local_shape": list(p.to_local().shape)}  # 2D step 2
                  for name, p in model.named_parameters() if name in SHOWN}  # 2D step 2
    if rank == 0:  # TP step 5
        print(f"{NAME}: {args.layout} mesh {dict(zip(names, mesh.shape))}, {model.num_params():,} parameters, "  # 2D step 1
              f"{local:,} on rank 0 ({device}, {dist.get_backend()}), {data.name}, batch {args.batch_size}", flush=True)

    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch("train", step, args.batch_size, args.seed))
        rows = slice(dp_rank * args.batch_size // dp_size, (dp_rank + 1) * args.batch_size // dp_size)  # 2D step 4
        x, y = x[rows], y[rows]  # 2D step 4: this data-parallel group's slice of the batch
        with loss_context(args):  # 2D step 3
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        whole = torch.tensor(loss.item(), dtype=torch.float64, device=device)  # 2D step 4: the whole batch's loss,
        dist.all_reduce(whole, op=dist.ReduceOp.AVG, group=dp_group)  # the mean over the data-parallel slices
        losses.append(whole.item())
        if rank == 0:  # TP step 5
            writer.add_scalar("train/loss", losses[-1], step + 1)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):  # TP step 5
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    seconds = time.perf_counter() - start

    val_loss, val_accuracy = evaluate(model, data, device, args)  # 2D step 3
    state = full_state_dict(model)  # TP step 5
    dist.barrier()  # TP step 5: every rank done before any leaves: gloo's exit race, notebook 03
    if rank != 0:  # TP step 5
        dist.destroy_process_group()
        return
    writer.add_scalar("val/accuracy", val_accuracy, args.steps)
    writer.close()
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.save + ".tmp")  # TP step 5
        os.replace(args.save + ".tmp", args.save)
    save_json({"script": NAME, "world_size": world_size, "device": str(device), "config": cfg.to_dict(),
               "layout": args.layout, "mesh": dict(zip(names, mesh.shape)),  # 2D step 1
               "sequence_parallel": args.sequence_parallel, "params_per_rank": local,  # TP step 5
               "placements_rank0": placements,  # 2D step 2
               "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
               "params": model.num_params(), "losses": losses, "val_loss": val_loss,
               "val_accuracy": val_accuracy, "train_seconds": seconds}, Path(args.run_dir) / "metrics.json")
    print(f"done: {args.steps} steps in {seconds:.1f} s, val loss {val_loss:.4f}, "
          f"exact answers {val_accuracy:.1%}", flush=True)
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()  # TP step 1


if __name__ == "__main__":
    main()
