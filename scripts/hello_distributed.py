# Written by notebooks/00_environment.ipynb - edit it there; running the notebook rewrites this file.
"""Hello, distributed: each rank reports itself, checks an all_reduce, and times it for growing messages.

    torchrun --standalone --nproc-per-node=2 scripts/hello_distributed.py
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist

from course.args import nonnegative_int, positive_int, repo_path
from course.errors import record
from course.hardware import backend_for, pick_device
from course.hello import time_all_reduce
from course.runlog import RunLog


@record  # a crash shows this rank's traceback in torchrun's report, not "error_file: <N/A>"
def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=repo_path, default="runs/00_environment/default")
    parser.add_argument("--max-mib", type=nonnegative_int, default=16,
                        help="largest all_reduce message, in MiB (0: no timing, only the hello and the sum)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds of every timing")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])  # global: unique across every machine in the job
    local_rank = int(os.environ["LOCAL_RANK"])  # on this machine: picks the device
    world_size = int(os.environ["WORLD_SIZE"])  # processes in the whole job
    node_rank = int(os.environ.get("GROUP_RANK", "0"))  # which machine (torchrun's "group" of workers)
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank starts on cuda:0
    dist.init_process_group(backend_for(device))
    print(f"rank {rank} of {world_size} (node {node_rank}, local rank {local_rank}) "
          f"on {socket.gethostname()}, pid {os.getpid()}: device {device}, backend {dist.get_backend()}, "
          f"{torch.get_num_threads()} CPU thread(s)", flush=True)

    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)  # default op is SUM; every rank receives the result, in place
    expected = sum(r + 1.0 for r in range(world_size))  # what every rank contributed
    assert total.item() == expected, f"all_reduce gave {total.item()}, expected {expected}"
    print(f"rank {rank}: all_reduce sum = {total.item():.0f} (expected {expected:.0f})", flush=True)

    log = RunLog(args.run_dir, enabled=rank == 0, world_size=world_size, backend=dist.get_backend(),
                 device=device.type)
    results = {"all_reduce_sum": total.item(), "expected_sum": expected}
    if args.max_mib and world_size > 1:  # every rank times together: all_reduce is a collective
        results.update(time_all_reduce(device, args.max_mib, args.rounds, log, show=rank == 0))
    log.finish(**results)
    dist.barrier()  # every rank finishes its collectives before any leaves (notebook 03 says why)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
