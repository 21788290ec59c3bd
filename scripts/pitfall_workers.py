# Written by notebooks/04_pitfalls.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall 4 of notebook 04: DataLoader workers and CPU threads per rank, measured side by side.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_workers.py --configs 0:1 2:1 0:2
Each configuration WORKERS:THREADS (DataLoader worker processes and CPU compute threads, per rank)
trains the flowers CNN for a few steps. All run in this one job, interleaved and repeated
(course.measure.compare), after warm-up steps that are not timed; rank 0 prints samples/s of the job.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course.args import positive_int, repo_path
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, cpu_cores, pick_device
from course.measure import StepTimer, compare
from course.models import build_model
from course.runlog import RunLog


def samples_per_s(model, optimizer, sampler, train_set, device, workers, threads, args) -> float:
    """Train args.steps timed steps (after args.warmup untimed ones); samples/s summed over the ranks."""
    torch.set_num_threads(threads)  # what OMP_NUM_THREADS sets at start-up
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda")  # pinned memory only speeds up copies to a GPU
    batches = iter(loader)  # starts this rank's worker processes
    timer = StepTimer(warmup_steps=args.warmup)
    timer.start()
    for _ in range(args.warmup + args.steps):
        images, labels = next(batches)
        loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        timer.tick(len(labels))
    del batches  # ends the worker processes
    rate = torch.tensor([timer.samples_per_s], device=device)
    dist.all_reduce(rate)  # the job's samples/s: the sum over ranks
    return rate.item()


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=None, metavar="WORKERS:THREADS",
                        help="default: 0 and 2 workers at cores/ranks threads, then 0 workers at `cores` threads")
    parser.add_argument("--steps", type=positive_int, default=6, help="timed steps per measurement")
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=positive_int, default=2, help="each configuration this many times")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--run-dir", type=repo_path, default="runs/04_pitfalls/workers")
    args = parser.parse_args()
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    cores = cpu_cores()
    fair = max(1, cores // world_size)  # threads per rank when the ranks share the cores
    configs = args.configs or [f"0:{fair}", f"2:{fair}", f"0:{cores}"]
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    with reported_once(rank):
        train_set, _, num_classes = build_datasets("flowers")  # JPEGs: decoding costs CPU, as real data does
        log = RunLog(args.run_dir, enabled=rank == 0, world_size=world_size, cores=cores)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=120))

    torch.manual_seed(0)
    model = DDP(build_model("cnn", num_classes).to(device), device_ids=[device.index] if device.index is not None else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(train_set, seed=0)
    runs, busy = {}, {}
    for config in configs:
        workers, threads = map(int, config.split(":"))
        name = f"{workers} worker{'s' * (workers != 1)}, {threads} thread{'s' * (threads != 1)} per rank"
        runs[name] = (lambda w=workers, t=threads: samples_per_s(model, optimizer, sampler, train_set, device,
                                                                  w, t, args))
        busy[name] = world_size * (threads + workers)  # processes and threads that want a core at once

    def progress(round_index, name, value):
        if rank == 0:
            print(f"round {round_index + 1}: {name}: {value:.1f} samples/s", flush=True)

    result = compare(runs, repeats=args.rounds, unit="samples/s", on_round=progress)
    if rank == 0:
        result.show()
        for name, count in busy.items():
            print(f"{name}: {count} things to run at once on {cores} cores", flush=True)
    log.finish(comparison=result.to_dict(), busy=busy)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
