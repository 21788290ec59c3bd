# Written by notebooks/12_composed_parallelism.ipynb - edit it there; running the notebook rewrites this file.
"""A small mixture-of-experts layer with expert parallelism: each rank holds one expert, and every token
travels to the rank of the expert its router picked (all_to_all_single, uneven splits) and back.

    torchrun --nproc-per-node=4 scripts/moe_layer.py     # 4 ranks, 4 experts, 32 tokens per rank

Checked against the same layer on one process (every rank gathers all tokens and computes it whole):
the outputs of its own tokens, its expert's gradients and the router's gradients (summed over ranks).
The collectives of one forward and backward are counted and set beside the prediction.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single  # differentiable: backward sends back

from course import flag
from course.args import JobParser, check_size, output_dir, positive_int
from course.comm_count import CollectiveCounter
from course.errors import reported_once
from course.hardware import backend_for, pick_device
from course.moe import moe_layer, moe_tokens  # the layer (router + experts) and each rank's tokens
from course.rundir import claim_run_dir


def expert_parallel(moe, x, rank, world_size):
    """The same layer with expert `rank` here only. Returns (output, splits sent, splits received)."""
    gate, expert = moe.route(x)  # the router is replicated: every rank routes its own tokens
    order = torch.argsort(expert, stable=True)  # group the tokens by destination rank (expert e lives on rank e)
    send = torch.bincount(expert, minlength=world_size)  # tokens for each rank: uneven
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # each rank learns how many tokens it will get from each rank
    send_splits, recv_splits = send.tolist(), recv.tolist()
    received = all_to_all_single(x[order], recv_splits, send_splits, dist.group.WORLD)  # dispatch
    done = moe.experts[rank](received)  # this rank's expert on every token sent to it
    back = all_to_all_single(done, send_splits, recv_splits, dist.group.WORLD)  # combine: the splits reversed
    out = torch.empty_like(back).index_copy(0, order, back)  # undo the sort: token i back in row i
    return gate[:, None] * out, send_splits, recv_splits


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=32, help="tokens on each rank")
    parser.add_argument("--width", type=positive_int, default=16)
    parser.add_argument("--run-dir", type=output_dir, default="runs/moe_layer")
    args = parser.parse_args()  # one error line for bad input, before the process group starts
    world = parser.world_size()  # one expert per process, however many: only torchrun's environment is needed
    # every rank builds all the experts (8 x width^2 weights each, with gradients) and its tokens' activations
    check_size(parser, f"--width {args.width}, --tokens {args.tokens}",
               4 * (16 * (world + 1) * args.width**2 + 32 * args.tokens * args.width))
    device = pick_device(int(os.environ["LOCAL_RANK"]))  # a GPU per rank if the launcher's plan gives one
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    rank = int(os.environ["RANK"])  # rank 0 writes --run-dir, so it claims it (staged: the launcher does)
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    dist.init_process_group(backend_for(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    moe = moe_layer(world_size, seed=0, width=args.width).to(device)  # the same layer on every rank
    x = moe_tokens(rank, args.tokens, width=args.width).to(device).requires_grad_()  # this rank's own tokens
    target = moe_tokens(rank, args.tokens, width=args.width, offset=200).to(device)

    counter = CollectiveCounter(world_size)
    with counter.phase("forward"):
        y, sent, got = expert_parallel(moe, x, rank, world_size)
    loss = (y * target).sum()  # this rank's part of a loss summed over all tokens
    with counter.phase("backward"):
        loss.backward()
    mine = {name: p.grad.clone() for name, p in moe.experts[rank].named_parameters()}
    x_grad = x.grad.clone()
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # the replicated router's gradient: the sum of every rank's part

    xs, targets = [torch.empty_like(x) for _ in range(world_size)], [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(xs, x.detach())
    dist.all_gather(targets, target)
    moe.zero_grad()
    every = torch.cat(xs).requires_grad_()
    whole = moe(every)  # the one-process layer on all tokens
    (whole * torch.cat(targets)).sum().backward()
    here = slice(rank * args.tokens, (rank + 1) * args.tokens)  # this rank's tokens among all
    diffs = {"output": (whole[here] - y).abs().max().item(), "input_grad": (every.grad[here] - x_grad).abs().max().item(),
             "router_grad": (moe.router.weight.grad - router_grad).abs().max().item(),
             "expert_grads": max((p.grad - mine[n]).abs().max().item() for n, p in moe.experts[rank].named_parameters())}
    worst = torch.tensor(max(diffs.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    splits = [torch.zeros(world_size, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(splits, torch.tensor(sent, device=device))
    summary = counter.summary()
    row = args.width * x.element_size()  # one token's activations, in bytes
    # counted: the tensor each all-to-all is given; dispatch gets this rank's tokens, combine its expert's outputs
    trips = (args.tokens + sum(got)) * row  # each token goes out once and comes back once
    predicted = {"forward": {"all-to-all": [3, world_size * 8 + trips]},  # counts (int64), dispatch, combine
                 "backward": {"all-to-all": [2, trips]}}  # the gradients make both trips in reverse
    if rank == 0:
        metrics = {"script": "moe_layer", "world_size": world_size, "tokens_per_rank": args.tokens,
                   "width": args.width, "splits": [s.tolist() for s in splits], "differences_rank0": diffs,
                   "max_difference_all_ranks": worst.item(), "counted": summary, "predicted": predicted,
                   "bytes_per_token": {"forward": 2 * row, "backward": 2 * row},
                   "tokens_leaving_their_rank": sum(v for i, s in enumerate(splits) for j, v in enumerate(s.tolist()) if i != j)}
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(args.run_dir) / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2))
        os.replace(tmp, Path(args.run_dir) / "metrics.json")
        print(f"tokens each rank sends to rank 0..{world_size - 1} (row = sender):", flush=True)
        for i, s in enumerate(splits):
            print(f"  rank {i}: {s.tolist()}", flush=True)
        print(f"largest difference from one process, all ranks: {worst.item():.1e}", flush=True)
        print(f"counted on rank 0: {summary}; predicted: {predicted}", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
