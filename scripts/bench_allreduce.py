# Written by notebooks/05_performance.ipynb - edit it there; running the notebook rewrites this file.
"""All-reduce bandwidth from a few KB to --max-mb MB, next to a local memory copy of the same size.

    torchrun --standalone --nproc-per-node=2 scripts/bench_allreduce.py --max-mb 64

For S bytes all-reduced by n ranks in t seconds (the definitions of nccl-tests, doc/PERFORMANCE.md):
  algbw = S / t                      what the caller sees
  busbw = algbw * 2(n-1)/n           a ring all-reduce moves 2(n-1)/n * S through each rank's link, so
                                     busbw is comparable to a link's speed whatever n is
copy = S / t_copy: one local tensor copy of S bytes (it reads S and writes S). GB = 1e9 bytes.
Each size: --warmup untimed calls, then timed calls (at least 3, more for small sizes); the median of
the slowest rank is reported.
"""
import argparse
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from course.args import positive_float, positive_int, repo_path
from course.errors import record
from course.hardware import backend_for, pick_device
from course.runlog import RunLog


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw * 2(n-1)/n."""
    return algbw * 2 * (world_size - 1) / world_size


def median_seconds(fn, calls: int, warmup: int, sync) -> float:
    """Median time of ``calls`` calls after ``warmup`` untimed ones, on the slowest rank."""
    times = []
    for i in range(warmup + calls):
        sync()
        begin = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    slowest = torch.tensor(statistics.median(times))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # outside the timed region
    return slowest.item()


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-kb", type=positive_float, default=4)
    parser.add_argument("--max-mb", type=positive_float, default=64)
    parser.add_argument("--factor", type=positive_int, default=4, help="each size is this times the previous")
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed calls per size")
    parser.add_argument("--run-dir", type=repo_path, default="runs/05_performance/allreduce")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device))
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)

    sizes, size = [], int(args.min_kb * 1024)
    while size <= args.max_mb * 2**20:
        sizes.append(size)
        size *= args.factor
    rows = []
    if rank == 0:
        print(f"{world_size} ranks, {backend_for(device)} on {device.type}")
        print(f"{'size':>9} {'time (us)':>10} {'algbw GB/s':>10} {'busbw GB/s':>10} {'copy GB/s':>9}", flush=True)
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        copy = torch.empty_like(tensor)
        calls = max(3, min(50, int(2e8 / size)))  # about 0.2 GB per size: small sizes get more calls
        t = median_seconds(partial(dist.all_reduce, tensor), calls, args.warmup, sync)
        t_copy = median_seconds(partial(copy.copy_, tensor), calls, args.warmup, sync)
        algbw = size / t / 1e9
        rows.append({"bytes": size, "time_s": t, "algbw_GBps": algbw, "busbw_GBps": bus_bandwidth(algbw, world_size),
                     "copy_GBps": size / t_copy / 1e9, "calls": calls})
        if rank == 0:
            r = rows[-1]
            label = f"{size / 2**20:g} MB" if size >= 2**20 else f"{size / 1024:g} KB"
            print(f"{label:>9} {t * 1e6:>10.0f} {algbw:>10.3f} {r['busbw_GBps']:>10.3f} {r['copy_GBps']:>9.2f}",
                  flush=True)
    RunLog(args.run_dir, enabled=rank == 0, script="bench_allreduce", world_size=world_size, device=str(device),
           backend=backend_for(device)).finish(results=rows)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
