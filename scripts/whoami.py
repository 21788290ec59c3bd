# Written by notebooks/06_multinode_and_faults.ipynb - edit it there; running the notebook rewrites this file.
"""Who is who: each process prints what torchrun told it, then the group checks itself with one all_reduce.

    torchrun --standalone --nproc-per-node=2 scripts/whoami.py
    # on each of two machines (c10d rendezvous; HOST is the first machine's address):
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=job1 scripts/whoami.py

Faults to study (notebook 06): --crash-rank R fails rank R in the first attempt (with torchrun --max-restarts);
--rank0-late S delays rank 0 of a restarted attempt; --absent-rank R keeps rank R away from the barrier that
the others wait at (who is missing?).
"""
import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from course.args import nonnegative_int, positive_float
from course.errors import record
from course.hardware import backend_for, pick_device

SHOWN = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=positive_float, default=60, help="seconds a collective may wait")
    parser.add_argument("--crash-rank", type=nonnegative_int, help="this rank raises in the first attempt")
    parser.add_argument("--rank0-late", type=positive_float, help="seconds rank 0 of a restarted attempt waits "
                        "before joining the group (as a slower machine would)")
    parser.add_argument("--absent-rank", type=nonnegative_int, help="this rank never reaches the barrier")
    parser.add_argument("--wait", choices=["monitored_barrier", "all_reduce"], default="monitored_barrier",
                        help="what the others wait in for the absent rank (monitored_barrier names it)")
    return parser.parse_args()


@record
def main():
    args = parse_args()
    env = {name: os.environ.get(name, "-") for name in SHOWN}
    rank, attempt = int(env["RANK"]), int(env["TORCHELASTIC_RESTART_COUNT"])
    device = pick_device(int(env["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    # The agent (this node's torchrun) is the parent process: its pid decides the c10d node order on one host.
    # One string, one write: torchrun runs ranks with python -u, so print(a, b) writes a, " " and b apart, and
    # torchrun's tee can read between them and show one line as two.
    ids = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"{ids} host={socket.gethostname()} agent_pid={os.getppid()}", flush=True)
    timeout = timedelta(seconds=args.timeout)
    if args.rank0_late and rank == 0 and attempt > 0:
        time.sleep(args.rank0_late)
    dist.init_process_group(backend_for(device), timeout=timeout)
    world = dist.get_world_size()
    # monitored_barrier exists only in gloo: with nccl, the waiting happens in a gloo group of its own.
    gloo = dist.new_group(backend="gloo") if backend_for(device) != "gloo" else None

    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)
    if rank == 0:
        print(f"all_reduce over {world} ranks: sum of ranks {total.item():.0f} (expected {world * (world - 1) // 2})",
              flush=True)
    if rank == args.crash_rank and attempt == 0:
        raise RuntimeError(f"injected crash: rank {rank} in attempt {attempt} (--crash-rank)")

    if args.absent_rank is not None:
        if rank == args.absent_rank:
            time.sleep(10 * args.timeout)  # never arrives; torchrun ends it once another rank has failed
        elif args.wait == "monitored_barrier":
            if rank == 0:
                print(f"rank 0 waits at monitored_barrier (timeout {args.timeout:g} s)", flush=True)
            dist.monitored_barrier(gloo, timeout=timeout, wait_all_ranks=True)
        else:
            dist.all_reduce(total)  # a plain collective: it waits, silently, until the process-group timeout
            if device.type != "cpu":
                torch.accelerator.synchronize()
    dist.barrier()
    if rank == 0:
        print(f"attempt {attempt}: all {world} ranks passed the barrier", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
