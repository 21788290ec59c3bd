"""Hello, distributed: each rank reports itself, checks an all_reduce, and times it.

    torchrun --standalone --nproc-per-node=2 scripts/hello_distributed.py
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from course.hardware import backend_for, pick_device
from course.runlog import RunLog


@record  # a crash shows this rank's traceback in torchrun's report, not "error_file: <N/A>"
def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", default="runs/00_hello/default")
    parser.add_argument("--max-mib", type=int, default=16, help="largest all_reduce tensor, in MiB")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])  # global: unique across every machine in the job
    local_rank = int(os.environ["LOCAL_RANK"])  # on this machine: picks the device
    world_size = int(os.environ["WORLD_SIZE"])
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank starts on cuda:0
    dist.init_process_group(backend_for(device))
    print(f"rank {rank} of {world_size} (local rank {local_rank}) on {socket.gethostname()}, pid {os.getpid()}: "
          f"device {device}, backend {dist.get_backend()}, {torch.get_num_threads()} CPU thread(s)", flush=True)

    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)  # default op is SUM, and every rank receives the result
    expected = world_size * (world_size + 1) / 2
    assert total.item() == expected, f"all_reduce gave {total.item()}, expected {expected}"
    print(f"rank {rank}: all_reduce sum = {total.item():.0f} (expected {expected:.0f})", flush=True)

    log = RunLog(args.run_dir, enabled=rank == 0, world_size=world_size, backend=dist.get_backend(),
                 device=device.type)
    bandwidth = {}
    mib = 1 / 64
    while mib <= args.max_mib:
        tensor = torch.ones(int(mib * 2**20) // 4, device=device)  # fp32: 4 bytes per element
        dist.all_reduce(tensor)  # warm-up: the first call sets up connections
        repeats = 5
        if device.type != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        if device.type != "cpu":
            torch.accelerator.synchronize()
        seconds = (time.perf_counter() - start) / repeats
        # "Bus bandwidth": bytes each rank must send in a ring all_reduce, per second. Comparable across sizes.
        bus_gbps = 2 * (world_size - 1) / world_size * tensor.numel() * 4 / seconds / 1e9
        kib = int(mib * 1024)
        log.scalar("all_reduce/bus_bandwidth_GBps", bus_gbps, kib)
        log.scalar("all_reduce/time_ms", seconds * 1e3, kib)
        bandwidth[kib] = round(bus_gbps, 3)
        if rank == 0:
            print(f"all_reduce {kib:>6} KiB: {seconds * 1e3:8.2f} ms, bus bandwidth {bus_gbps:6.2f} GB/s", flush=True)
        mib *= 4
    log.finish(all_reduce_sum=total.item(), expected_sum=expected, bus_bandwidth_GBps_by_KiB=bandwidth)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
