# Written by notebooks/04_pitfalls.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall 4 of notebook 04: DataLoader workers and CPU threads per rank, measured side by side.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_workers.py --configs 0:1 2:1 0:2
Each configuration WORKERS:THREADS (DataLoader worker processes and CPU compute threads, per rank)
trains the flowers CNN for a few steps. All run in this one job, interleaved and repeated
(course.measure.compare), after warm-up steps that are not timed; rank 0 prints samples/s of the job.
A configuration's workers start once, from a fork server, and serve all its rounds (make_loader).
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

PREFETCH = 2  # batches each worker prepares ahead (DataLoader's default prefetch_factor)
LOADER_TIMEOUT_S = 60  # a batch that takes longer is an error on this rank, not a hang of the job


def make_loader(dataset, sampler, workers: int, batch_size: int, pin_memory: bool = False) -> DataLoader:
    """A DataLoader whose worker processes start from a fork server, once (persistent_workers).

    Linux's default, fork, copies this process with only the thread that forks. Gloo's and OpenMP's
    threads are not copied, and a lock one of them held at that moment stays held in the worker: a
    worker that waits for it never delivers, and its rank never reaches the next collective. The fork
    server is a fresh process without those threads: workers forked from it start clean."""
    if workers == 0:
        return DataLoader(dataset, batch_size, sampler=sampler, pin_memory=pin_memory)
    return DataLoader(dataset, batch_size, sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                      multiprocessing_context="forkserver", persistent_workers=True, prefetch_factor=PREFETCH,
                      timeout=LOADER_TIMEOUT_S)


class Batches:
    """Batches from one loader without end: at the end of an epoch, set_epoch (pitfall 2) and go on."""

    def __init__(self, loader: DataLoader):
        self.loader, self.epoch = loader, 0
        self.batches = iter(loader)  # starts the loader's worker processes, if it has any

    def __next__(self):
        try:
            return next(self.batches)
        except StopIteration:
            self.epoch += 1
            self.loader.sampler.set_epoch(self.epoch)
            self.batches = iter(self.loader)  # persistent workers: the same processes go on
            return next(self.batches)


def samples_per_s(model, optimizer, batches: Batches, device, threads: int, warmup: int, steps: int) -> float:
    """Train ``steps`` timed steps after ``warmup`` untimed ones; samples/s summed over the ranks."""
    torch.set_num_threads(threads)  # what OMP_NUM_THREADS sets at start-up
    sync = torch.accelerator.synchronize if device.type != "cpu" else None
    timer = StepTimer(warmup_steps=warmup, sync=sync)
    timer.start()
    for _ in range(warmup + steps):
        images, labels = next(batches)
        loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        timer.tick(len(labels))
    rate = torch.tensor([timer.samples_per_s], device=device)
    dist.all_reduce(rate)  # the job's samples/s: the sum over ranks
    return rate.item()


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=None, metavar="WORKERS:THREADS",
                        help="default: 0 and 2 workers at cores/ranks threads, then 0 workers at `cores` threads")
    parser.add_argument("--steps", type=positive_int, default=6, help="timed steps per measurement")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untimed steps first (plus the batches a configuration's workers prepared ahead)")
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
    runs, busy, feeds = {}, {}, []
    for config in configs:
        workers, threads = map(int, config.split(":"))
        name = f"{workers} worker{'s' * (workers != 1)}, {threads} thread{'s' * (threads != 1)} per rank"
        loader = make_loader(train_set, DistributedSampler(train_set, seed=0), workers, args.batch_size,
                             pin_memory=device.type == "cuda")  # pinned memory only speeds up copies to a GPU
        feeds.append(Batches(loader))
        warmup = args.warmup + workers * PREFETCH  # batches prepared while other configurations ran: untimed
        runs[name] = (lambda b=feeds[-1], t=threads, w=warmup: samples_per_s(model, optimizer, b, device, t, w,
                                                                             args.steps))
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
    runs.clear()
    feeds.clear()  # the last references to the iterators: their worker processes end here
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
