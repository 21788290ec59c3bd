# Reference solution of exercise 9 of notebooks/12_composed_parallelism.ipynb: look after you have tried.
"""Exercise 9: expert parallelism by hand on 2 processes. Each rank holds one expert of a small
mixture-of-experts layer; every token travels to the rank of its expert and back with all_to_all_single.

Fill the lines marked TODO, then run `exercises.check("9")` in notebook 12. The check launches this script
on 2 processes with a seed and numbers of tokens that are not the defaults (some so small that an expert
gets no token from some rank), and compares every rank's outputs, input gradients and its expert's
gradients with the whole layer computed on one process.

    torchrun --nproc-per-node=2 scripts/ex9_experts.py --out runs/12_composed_parallelism/ex9
"""
import argparse
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single  # differentiable

from course.moe import moe_layer, moe_tokens


def expert_parallel(moe, x, rank, world_size):
    """The layer with only expert `rank` on this rank: route, dispatch, compute, combine."""
    gate, expert = moe.route(x)  # which expert (= which rank) each of this rank's tokens goes to
    order = torch.argsort(expert, stable=True)  # this rank's tokens, grouped by destination rank
    send = torch.bincount(expert, minlength=world_size)  # how many tokens go to each rank
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # how many tokens come from each rank
    send_splits, recv_splits = send.tolist(), recv.tolist()
    received = all_to_all_single(x[order], recv_splits, send_splits, dist.group.WORLD)  # dispatch
    done = moe.experts[rank](received)  # this rank's expert on every token it received
    back = all_to_all_single(done, send_splits, recv_splits, dist.group.WORLD)  # combine: the splits reversed
    out = torch.empty_like(back).index_copy(0, order, back)  # back in the tokens' own order
    return gate[:, None] * out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[16],
                        help="tokens on each rank; several numbers: one pass of the layer for each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/12_composed_parallelism/ex9", help="where each rank saves")
    parser.add_argument("--timeout", type=float, default=60, help="process-group timeout, seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))  # CPU tensors, any machine
    rank, world_size = dist.get_rank(), dist.get_world_size()
    moe = moe_layer(world_size, args.seed)  # the same layer on every rank: router and one expert per rank
    results = []
    for tokens in args.tokens:  # with few tokens, some rank may send an expert none
        x = moe_tokens(rank, tokens, args.seed).requires_grad_()  # this rank's own tokens
        moe.zero_grad()
        y = expert_parallel(moe, x, rank, world_size)
        y.sum().backward()
        results.append({"tokens": tokens, "y": y.detach(), "x_grad": x.grad,
                        "expert_grads": {n: p.grad for n, p in moe.experts[rank].named_parameters()}})

    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save(results, Path(args.out) / f"ex9_rank{rank}.pt")
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
