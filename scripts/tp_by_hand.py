# Written by notebooks/10_tensor_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Tensor parallelism by hand: the GPT's MLP split over the ranks with plain torch.distributed collectives.

    torchrun --nproc-per-node=2 scripts/tp_by_hand.py

fc (width -> 4 x width) is split by output columns, proj (4 x width -> width) by input rows. Two small
autograd functions carry all the communication (Megatron-LM calls them f and g):
  Copy:   identity forward, all-reduce backward  (before the column-parallel layer)
  Reduce: all-reduce forward, identity backward  (after the row-parallel layer)
Every rank also builds the unsplit MLP from the same seed and checks the split one against it:
the output, the input's gradient, and each rank's slice of every weight gradient.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course import flag
from course.args import JobParser, check_size, output_dir, positive_int
from course.errors import reported_once
from course.rundir import claim_run_dir


class Copy(torch.autograd.Function):
    """f: every rank already has the whole input. Backward: each rank's gradient is only its part of the sum."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # sum the input gradients of every rank's columns
        return grad


class Reduce(torch.autograd.Function):
    """g: each rank holds a partial sum of the output. Backward: the output's gradient is already whole."""

    @staticmethod
    def forward(ctx, partial):
        out = partial.clone()
        dist.all_reduce(out)  # partial sums over the rows -> the full output on every rank
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class ColumnParallelLinear(nn.Module):
    """This rank's output columns of ``full``: rows of its weight (out x in) and of its bias."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, dim=0)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(world, dim=0)[rank].clone())

    def forward(self, x):  # x: the whole input, on every rank
        return F.linear(Copy.apply(x), self.weight, self.bias)  # this rank's slice of the output


class RowParallelLinear(nn.Module):
    """This rank's input rows of ``full``: columns of its weight; the bias is added once, after the sum."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, dim=1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x_slice):  # x_slice: this rank's slice of the input features
        return Reduce.apply(F.linear(x_slice, self.weight)) + self.bias


class ParallelMLP(nn.Module):
    """Column then row: the 4 x wide activation never leaves its rank; one all-reduce each way."""

    def __init__(self, mlp, rank, world):
        super().__init__()
        self.fc = ColumnParallelLinear(mlp.fc, rank, world)
        self.proj = RowParallelLinear(mlp.proj, rank, world)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=positive_int, default=64)
    parser.add_argument("--tokens", type=positive_int, default=32, help="batch x sequence positions")
    parser.add_argument("--run-dir", type=output_dir, default="runs/tp_by_hand", help="metrics.json: the differences")
    args = parser.parse_args()
    world_size = parser.world_size()  # checked before the process group starts: one error line if it does not fit
    # two copies of the MLP (4 x width^2 weights each, with gradients) and the tokens' activations, fp32
    check_size(parser, f"--width {args.width}, --tokens {args.tokens}",
               4 * (20 * args.width**2 + 24 * args.tokens * args.width))
    if 4 * args.width % world_size:
        parser.error(f"argument --width: the MLP's 4 x {args.width} hidden columns do not split over {world_size} "
                     "processes")
    rank = int(os.environ["RANK"])  # rank 0 writes --run-dir, so it claims it (staged: the launcher does)
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    dist.init_process_group("gloo")  # CPU tensors: the lesson is the collectives, not the device
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same full MLP and input on every rank
    full = MLP(args.width)
    x = torch.randn(args.tokens, args.width, requires_grad=True)
    x_split = x.detach().clone().requires_grad_(True)
    split = ParallelMLP(full, rank, world)

    out_full, out_split = full(x), split(x_split)
    out_full.square().sum().backward()  # any loss will do: the same on both sides
    out_split.square().sum().backward()

    diffs = {
        "output": (out_full - out_split).abs().max().item(),
        "input_grad": (x.grad - x_split.grad).abs().max().item(),
        "fc.weight_grad": (full.fc.weight.grad.chunk(world, 0)[rank] - split.fc.weight.grad).abs().max().item(),
        "fc.bias_grad": (full.fc.bias.grad.chunk(world, 0)[rank] - split.fc.bias.grad).abs().max().item(),
        "proj.weight_grad": (full.proj.weight.grad.chunk(world, 1)[rank] - split.proj.weight.grad).abs().max().item(),
        "proj.bias_grad": (full.proj.bias.grad - split.proj.bias.grad).abs().max().item(),
    }
    worst = torch.tensor(max(diffs.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the verdict covers every rank
    held = sum(p.numel() for p in split.parameters())
    print(f"rank {rank}: holds {held:,} of {sum(p.numel() for p in full.parameters()):,} MLP parameters; "
          f"largest difference {max(diffs.values()):.1e} ({max(diffs, key=diffs.get)})", flush=True)
    if rank == 0:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        result = {"world_size": world, "width": args.width, "tokens": args.tokens, "differences_rank0": diffs,
                  "max_difference_all_ranks": worst.item(), "params_per_rank": held}
        (Path(args.run_dir) / "metrics.json.tmp").write_text(json.dumps(result, indent=2))
        os.replace(Path(args.run_dir) / "metrics.json.tmp", Path(args.run_dir) / "metrics.json")
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
