# Reference solution of exercise 7 of notebooks/10_tensor_parallel.ipynb: look after you have tried.
"""Exercise 7: column- and row-parallel linear layers by hand (the MLP of notebook 10, split over the ranks).

Fill the lines marked TODO, then run `exercises.check("7")` in notebook 10. The check launches this script
on 2 processes and compares, on every rank, the output, the input's gradient and each weight's gradient
(put back where its slice sits in the unsplit weight) with the unsplit MLP computed in one process.

    torchrun --nproc-per-node=2 scripts/ex7_tp.py --out runs/10_tensor_parallel/ex7
"""
import argparse
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Copy(torch.autograd.Function):
    """Before the column-parallel layer: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # each rank has its columns' share of the input's gradient: the sum
        return grad


class Reduce(torch.autograd.Function):
    """After the row-parallel layer: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, partial):
        out = partial.clone()
        dist.all_reduce(out)  # partial sums over the rows -> the whole output on every rank
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad  # already whole on every rank: summing it again would count it world times


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, dim=0)[rank].clone())  # out x in
        self.bias = nn.Parameter(full.bias.detach().chunk(world, dim=0)[rank].clone())

    def forward(self, x):
        return F.linear(Copy.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, dim=1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())  # added once, after the sum

    def forward(self, x_slice):
        return Reduce.apply(F.linear(x_slice, self.weight)) + self.bias


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/10_tensor_parallel/ex7", help="where each rank saves its results")
    parser.add_argument("--timeout", type=float, default=60, help="process-group timeout, seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))  # CPU tensors, any machine
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # the same unsplit MLP and input on every rank
    fc, proj = nn.Linear(args.width, 4 * args.width), nn.Linear(4 * args.width, args.width)
    x = torch.randn(args.tokens, args.width, requires_grad=True)
    col, row = ColumnParallelLinear(fc, rank, world), RowParallelLinear(proj, rank, world)
    out = row(F.gelu(col(x)))
    out.square().sum().backward()

    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save({"out": out.detach(), "x_grad": x.grad, "fc_weight_grad": col.weight.grad,
                "fc_bias_grad": col.bias.grad, "proj_weight_grad": row.weight.grad,
                "proj_bias_grad": row.bias.grad,  # and which slices this rank holds:
                "fc_weight": col.weight.detach(), "proj_weight": row.weight.detach()},
               Path(args.out) / f"ex7_rank{rank}.pt")
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
