# Written by notebooks/06_multinode_and_faults.ipynb - edit it there; running the notebook rewrites this file.
"""A hang the flight recorder explains: rank 0 calls all_reduce while rank 1 calls broadcast (gloo, CPU).

    torchrun --standalone --nproc-per-node=2 scripts/fr_mismatch.py --run-dir runs/fr --timeout 5

Both ranks first run --steps matching all_reduces, then the mismatched pair: gloo cannot match them, so both
wait until the process group's timeout. Each rank then writes its flight recorder buffer
(torch._C._distributed_c10d._dump_fr_trace(): the pickled records of its last collectives) to
RUN_DIR/flight_recorder/trace_<rank>, and exits 0, so that torchrun does not stop the other rank before it has
written its own file (a real job would re-raise the error).
"""
import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="the dumps go to RUN_DIR/flight_recorder/")
    parser.add_argument("--timeout", type=float, default=5, help="seconds the process group waits")
    parser.add_argument("--steps", type=int, default=2, help="matching all_reduces before the mismatch")
    return parser.parse_args()


def main():
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))  # a gloo lesson: the CPU always
    rank = dist.get_rank()
    x = torch.ones(1024)
    for _ in range(args.steps):
        dist.all_reduce(x)
    try:
        if rank == 0:
            dist.all_reduce(x)  # the bug: rank 0 takes one branch ...
        else:
            dist.broadcast(x, src=0)  # ... and rank 1 the other
    except RuntimeError as error:
        print(f"rank {rank}: {str(error).splitlines()[0].split('] ', 1)[-1]}", flush=True)  # gloo's text, no path
    folder = args.run_dir / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"trace_{rank}"
    path.write_bytes(_dump_fr_trace())
    print(f"rank {rank}: wrote {path.name} ({os.path.getsize(path)} bytes)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
