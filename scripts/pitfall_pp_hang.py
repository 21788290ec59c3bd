# Written by notebooks/11_pipeline_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall: a send without its receive. Two stages by hand, with blocking dist.send, in different orders.

    torchrun --nproc-per-node=2 scripts/pitfall_pp_hang.py           # hangs until the 5 s timeout
    torchrun --nproc-per-node=2 scripts/pitfall_pp_hang.py --fix     # rank 1 posts its sends with isend

Rank 0 runs GPipe: it sends every micro-batch's activations, then receives every gradient. Rank 1 answers each
micro-batch at once: receive, compute, send the gradient back. A gloo send waits until the other side
receives, so rank 0 waits in "send activations of micro-batch 1" while rank 1 waits in "send gradient of
micro-batch 0": each waits for a receive the other never posts. The first rank to time out closes the
connection, so the other may report that instead; each rank says which operation it was in.
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from course.args import JobParser, number, positive_float

MAX_MICROBATCHES = 100  # a lesson needs 2; 1,000 already took over a minute on 2 CPU cores, 1e9 would run for days


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fix", action="store_true", help="rank 1 sends with isend and waits at the end")
    parser.add_argument("--microbatches", type=number(int, 0, high=MAX_MICROBATCHES), default=2,
                        help=f"at most {MAX_MICROBATCHES}: with --fix, rank 1 holds every posted send until the end")
    parser.add_argument("--timeout", type=positive_float, default=5, help="seconds a send or receive may wait")
    args = parser.parse_args()
    if parser.world_size() != 2:  # before the process group starts: one error line
        parser.error(f"torchrun --nproc-per-node: the two stages need exactly 2 processes, not {parser.world_size()}")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))  # p2p by hand: CPU tensors
    rank, shape = dist.get_rank(), (8, 9, 64)
    doing = "start"
    try:
        if rank == 0:
            for mb in range(args.microbatches):  # all forwards ...
                doing = f"send activations of micro-batch {mb} to rank 1"
                dist.send(torch.randn(shape), dst=1)
            for mb in range(args.microbatches):  # ... then all backwards
                doing = f"recv gradient of micro-batch {mb} from rank 1"
                dist.recv(torch.empty(shape), src=1)
        else:
            pending = []
            for mb in range(args.microbatches):
                doing = f"recv activations of micro-batch {mb} from rank 0"
                h = torch.empty(shape)
                dist.recv(h, src=0)
                doing = f"send gradient of micro-batch {mb} to rank 0"
                if args.fix:
                    pending.append(dist.isend(2 * h, dst=0))  # posted; the transfer happens when rank 0 receives
                else:
                    dist.send(2 * h, dst=0)  # waits for rank 0's receive
            doing = "wait for the posted sends"
            for work in pending:
                work.wait()
    except RuntimeError as error:
        print(f"rank {rank}: stopped after {args.timeout:g} s while in: {doing} "
              f"(gloo: {str(error).splitlines()[0].split('] ')[-1]})", flush=True)
        time.sleep(2)  # let the other rank report too before torchrun ends it (a real job would just exit)
        raise SystemExit(1)
    print(f"rank {rank}: all {args.microbatches} micro-batches done", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
