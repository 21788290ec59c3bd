# Written by notebooks/11_pipeline_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall: shapes that differ between stages. A batch of 30 in 4 micro-batches is 8, 8, 8 and 6 samples.

    torchrun --nproc-per-node=2 scripts/pitfall_pp_shapes.py          # rank 1 receives into 8-sample buffers
    torchrun --nproc-per-node=2 scripts/pitfall_pp_shapes.py --fix    # rank 0 sends each shape first

A receive needs a buffer of the right shape before the data arrives. Rank 1 allocates every buffer like the
first micro-batch's (as torch.distributed.pipelining does: it infers the shapes once). gloo fills the first 6
samples of the last buffer and leaves the rest as it was (here NaN, to make it visible); nothing fails
until a shape meets the targets' (the loss), and a stage without a loss would compute on the stale rows.
The fix: equal micro-batches (a batch divisible by their number), or send each shape before its tensor.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.args import JobParser, positive_int


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fix", action="store_true", help="send a 3-number header with each tensor's shape")
    parser.add_argument("--batch-size", type=positive_int, default=30)
    parser.add_argument("--microbatches", type=positive_int, default=4)
    args = parser.parse_args()
    if parser.world_size() != 2:  # before the process group starts: one error line
        parser.error(f"torchrun --nproc-per-node: the two stages need exactly 2 processes, not {parser.world_size()}")
    dist.init_process_group("gloo")  # p2p by hand: CPU tensors
    rank = dist.get_rank()
    torch.manual_seed(0)
    x, y = torch.randn(args.batch_size, 9, 64), torch.randint(0, 12, (args.batch_size, 9))
    chunks = x.chunk(args.microbatches)
    for mb, (xm, ym) in enumerate(zip(chunks, y.chunk(args.microbatches))):
        if rank == 0:
            if args.fix:
                dist.send(torch.tensor(xm.shape), dst=1)  # the header: this micro-batch's shape
            dist.send(xm.contiguous(), dst=1)
            continue
        if args.fix:
            header = torch.empty(3, dtype=torch.long)
            dist.recv(header, src=0)
            shape = tuple(header.tolist())
        else:
            shape = chunks[0].shape  # the first micro-batch's shape, for every micro-batch
        h = torch.full(shape, float("nan"))
        dist.recv(h, src=0)
        stale = int(h.isnan().any(dim=(1, 2)).sum())
        print(f"rank 1: micro-batch {mb}: rank 0 sent {len(xm)} samples, buffer of {shape[0]}, "
              f"{stale} never written", flush=True)
        logits = h @ torch.randn(64, 12)  # a stand-in for the last stage
        loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten())
        print(f"rank 1: micro-batch {mb}: loss {loss.item():.3f}", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
