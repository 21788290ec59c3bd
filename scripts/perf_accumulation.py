# Written by notebooks/05_performance.ipynb - edit it there; running the notebook rewrites this file.
"""Gradient accumulation with DDP, checked against one process: N ranks x K micro-batches x B samples
must train exactly like one process with a batch of N*K*B.

    torchrun --standalone --nproc-per-node=2 scripts/perf_accumulation.py --micro-steps 4 --batch-size 16

Three ways to accumulate, each from the same weights on the same samples:
  right            loss / K, and model.no_sync() on every micro-step but the last: one all-reduce per step
  no_divide        bug: the loss is not divided by K, so the gradient is K times too large
  sync_every_step  bug: no no_sync(), so DDP all-reduces after every micro-step (same gradient, K x the traffic)
Every rank also trains the reference (a plain copy of the model, the whole N*K*B batch at once) and
reports the largest parameter difference; a counting hook reports the all-reduces per optimizer step.
"""
import argparse
import copy
import gc
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import default_collate

from course.args import nonnegative_int, positive_int, repo_path
from course.commhooks import CommCounter
from course.data import build_datasets
from course.errors import record
from course.hardware import backend_for, pick_device
from course.measure import compare
from course.models import mlp
from course.runlog import RunLog

VARIANTS = ("right", "no_divide", "sync_every_step")


def optimizer_step(model, optimizer, micro_batches, variant):
    """One optimizer step over K micro-batches: the lesson of this script."""
    k = len(micro_batches)
    for i, (images, labels) in enumerate(micro_batches):
        last = i == k - 1
        # no_sync(): backward() only accumulates into .grad; the all-reduce waits for the last micro-step.
        skip_sync = not last and variant != "sync_every_step"
        with model.no_sync() if skip_sync else nullcontext():  # the forward must be inside it too
            loss = nn.functional.cross_entropy(model(images), labels)
            (loss if variant == "no_divide" else loss / k).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-steps", type=positive_int, default=4, help="K: micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="B: samples per micro-batch, per rank")
    parser.add_argument("--steps", type=positive_int, default=5, help="optimizer steps compared with the reference")
    parser.add_argument("--time-rounds", type=nonnegative_int, default=2, help="rounds timing right vs sync_every_step")
    parser.add_argument("--run-dir", type=repo_path, default="runs/05_performance/accumulation")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device))
    n, k, b = world_size, args.micro_steps, args.batch_size

    train_set, _, _ = build_datasets("mnist")
    global_batches = []  # step s uses samples [s*N*K*B, (s+1)*N*K*B); rank r reads its K*B of them
    for s in range(args.steps):
        images, labels = default_collate([train_set[i] for i in range(s * n * k * b, (s + 1) * n * k * b)])
        global_batches.append((images.to(device), labels.to(device)))

    torch.manual_seed(0)
    start = mlp().to(device)
    reference = copy.deepcopy(start)  # one process, batch N*K*B, plain SGD step
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for images, labels in global_batches:
        nn.functional.cross_entropy(reference(images), labels).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)

    results, models = {}, {}
    for variant in VARIANTS:
        model = DDP(copy.deepcopy(start), device_ids=[device.index] if device.type != "cpu" else None)
        counter = CommCounter()
        counter.register(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        counts = []
        for images, labels in global_batches:
            mine = slice(rank * k * b, (rank + 1) * k * b)
            micro = list(zip(images[mine].split(b), labels[mine].split(b)))
            optimizer_step(model, optimizer, micro, variant)
            counts.append(counter.take())
        diff = max((p - r).abs().max().item() for p, r in zip(model.module.parameters(), reference.parameters()))
        results[variant] = {"max_param_diff": diff, "all_reduces_per_step": counts[-1][0],
                            "bytes_per_step": counts[-1][1]}
        models[variant] = (model, optimizer)

    def seconds_per_step(variant):
        """Median time of 3 optimizer steps after one untimed warm-up step (the slowest rank's)."""
        model, optimizer = models[variant]
        images, labels = global_batches[0]
        micro = list(zip(images[: k * b].split(b), labels[: k * b].split(b)))
        times = []
        for i in range(4):
            begin = time.perf_counter()
            optimizer_step(model, optimizer, micro, variant)
            if i:
                times.append(time.perf_counter() - begin)
        slowest = torch.tensor(statistics.median(times))
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()

    timing = None
    if args.time_rounds:  # every rank runs the same configurations in the same interleaved order
        timing = compare({v: (lambda v=v: seconds_per_step(v)) for v in ("right", "sync_every_step")},
                         repeats=args.time_rounds, unit="s/step", higher_is_better=False)
    if rank == 0:
        print(f"N={n} ranks x K={k} micro-steps x B={b} = global batch {n * k * b}, {args.steps} optimizer steps")
        for variant, r in results.items():
            print(f"{variant:<16} max |param - reference| {r['max_param_diff']:.2e}   "
                  f"all-reduces per optimizer step {r['all_reduces_per_step']}", flush=True)
        if timing:
            timing.show()
            print(timing.verdict("sync_every_step", "right"), flush=True)
    RunLog(args.run_dir, enabled=rank == 0, script="perf_accumulation", world_size=n, micro_steps=k, batch_size=b,
           global_batch=n * k * b, steps=args.steps, device=str(device)).finish(
        results=results, timing=timing.to_dict() if timing else None)
    models.clear()
    model = optimizer = None
    gc.collect()  # free the DDP models first: otherwise gloo sometimes aborts at exit (torch 2.14, CPU)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
