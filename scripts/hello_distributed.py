# Written by notebooks/00_environment.ipynb - edit it there; running the notebook rewrites this file.
"""Hello, distributed: each rank reports itself, checks an all_reduce, and times it against a local copy.

    torchrun --standalone --nproc-per-node=2 scripts/hello_distributed.py
"""
import argparse
import os
import socket
import statistics

import torch
import torch.distributed as dist

from course.args import nonnegative_int, positive_int, repo_path
from course.errors import record
from course.hardware import backend_for, pick_device
from course.measure import compare, time_call
from course.runlog import RunLog


@record  # a crash shows this rank's traceback in torchrun's report, not "error_file: <N/A>"
def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=repo_path, default="runs/00_environment/default")
    parser.add_argument("--max-mib", type=nonnegative_int, default=16,
                        help="largest all_reduce message, in MiB (0: no timing, only the hello and the sum)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of all_reduce vs local copy")
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
    expected = world_size * (world_size + 1) / 2
    assert total.item() == expected, f"all_reduce gave {total.item()}, expected {expected}"
    print(f"rank {rank}: all_reduce sum = {total.item():.0f} (expected {expected:.0f})", flush=True)

    log = RunLog(args.run_dir, enabled=rank == 0, world_size=world_size, backend=dist.get_backend(),
                 device=device.type)
    results = {"all_reduce_sum": total.item(), "expected_sum": expected}
    if args.max_mib and world_size > 1:
        results.update(benchmark(args, device, rank, world_size, log))
    log.finish(**results)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


def benchmark(args, device, rank, world_size, log) -> dict:
    """all_reduce time and bus bandwidth for growing messages, then all_reduce vs a local copy."""
    def seconds_per_call(fn) -> float:  # median of 9 calls, after 1 untimed warm-up call
        def call():
            fn()
            if device.type != "cpu":
                torch.accelerator.synchronize()  # GPU work is queued: wait for it before reading the clock
        return statistics.median(time_call(call, repeats=9, warmup=1))

    ring = 2 * (world_size - 1) / world_size  # share of the message each rank sends in a ring all_reduce
    bandwidth = {}
    kib = 16
    while kib <= args.max_mib * 1024:
        tensor = torch.zeros(kib * 1024 // 4, device=device)  # fp32: 4 bytes per element
        seconds = seconds_per_call(lambda t=tensor: dist.all_reduce(t))
        bus_gbps = ring * tensor.nbytes / seconds / 1e9  # "bus bandwidth": comparable across world sizes
        log.scalar("all_reduce/bus_bandwidth_GBps", bus_gbps, kib)  # TensorBoard's step axis = size in KiB
        log.scalar("all_reduce/time_ms", seconds * 1e3, kib)
        bandwidth[kib] = round(bus_gbps, 3)
        if rank == 0:
            print(f"all_reduce {kib:>6} KiB: {seconds * 1e3:8.2f} ms, bus bandwidth {bus_gbps:6.2f} GB/s",
                  flush=True)
        kib *= 4

    # The largest message again, interleaved with a copy of it inside this process's memory. Every rank runs
    # the same rounds in the same order: all_reduce is a collective, so all ranks must call it together.
    source, target = tensor, torch.empty_like(tensor)

    def all_reduce_gbps():
        return ring * source.nbytes / seconds_per_call(lambda: dist.all_reduce(source)) / 1e9

    def copy_gbps():
        return source.nbytes / seconds_per_call(lambda: target.copy_(source)) / 1e9

    result = compare({"all_reduce (bus bandwidth)": all_reduce_gbps, "local copy": copy_gbps},
                     repeats=args.rounds, unit="GB/s")
    verdict = result.verdict("local copy", "all_reduce (bus bandwidth)")
    if rank == 0:
        print(f"\n{source.nbytes / 2**20:.0f} MiB, {args.rounds} interleaved rounds:",
              result.table(), verdict, sep="\n", flush=True)
    return {"bus_bandwidth_GBps_by_KiB": bandwidth, "compared_MiB": source.nbytes / 2**20,
            "comparison": result.to_dict(), "verdict": verdict}


if __name__ == "__main__":
    main()
