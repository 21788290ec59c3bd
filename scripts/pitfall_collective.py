# Written by notebooks/04b_pitfalls_reference.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall 12 (notebook 04b): a collective that only some ranks call.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_collective.py --bug --timeout 10  # hangs
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ... scripts/pitfall_collective.py --bug  # names the mismatch
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_collective.py         # every rank calls it
While it hangs, `kill -USR1 <pid>` (each rank prints its pid first) prints that rank's Python stack.
"""
import argparse
import faulthandler
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from course.args import positive_float, positive_int
from course.errors import record
from course.hardware import backend_for, pick_device


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", action="store_true", help="all_reduce inside `if rank == 0:`")
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--timeout", type=positive_float, default=60, help="process-group timeout, seconds")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: print every thread's stack
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=args.timeout))
    print(f"rank {rank}: pid {os.getpid()}", flush=True)

    torch.manual_seed(rank)
    for step in range(1, args.steps + 1):
        loss = torch.rand(1, device=device)  # stands for this rank's loss on its share of the batch
        time.sleep(0.1)
        if step % 3 == 0:
            if not args.bug or rank == 0:  # BUG when --bug: only rank 0 enters the collective
                dist.all_reduce(loss)  # every rank must call every collective, in the same order
            if rank == 0:
                print(f"step {step}: mean loss {loss.item() / dist.get_world_size():.3f}", flush=True)
    print(f"rank {rank}: at the final barrier", flush=True)
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
