# Written by notebooks/05_performance.ipynb - edit it there; running the notebook rewrites this file.
"""Where a DDP step's time goes: one model under several DDP settings, timed side by side in one job.

    torchrun --standalone --nproc-per-node=2 scripts/perf_step.py --model resnet18 --configs sync,no_sync
    torchrun --standalone --nproc-per-node=2 scripts/perf_step.py --model mlp --trace runs/05_performance/trace

Configurations (--configs, comma-separated), each a DDP model built from the same weights:
  sync         DDP's defaults (25 MB buckets): forward, backward with the gradient all-reduce, optimizer
  no_sync      the same model and step inside model.no_sync(): no all-reduce, so compute only
  bucket1, bucket100           bucket_cap_mb=1 / 100
  view         gradient_as_bucket_view=True: the gradients are views into the all-reduce buckets
  static       static_graph=True: DDP may cache what it learns about the graph in the first steps
  find_unused  find_unused_parameters=True: after each forward, search the graph for unused parameters
  compiled     torch.compile(DDP(model)): the first step compiles
Every rank runs them in the same interleaved order (course.measure.compare); each call times --steps steps
after one untimed warm-up step. A counting hook (course.commhooks) is on in every configuration.
The input is one fixed random batch: this times the step, not the data loading.
"""
import argparse
import gc
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from course.args import positive_int, repo_path
from course.commhooks import CommCounter
from course.errors import record
from course.hardware import backend_for, pick_device
from course.measure import compare
from course.models import build_model
from course.runlog import RunLog

OPTIONS = {"sync": {}, "no_sync": {}, "bucket1": {"bucket_cap_mb": 1}, "bucket100": {"bucket_cap_mb": 100},
           "view": {"gradient_as_bucket_view": True}, "static": {"static_graph": True},
           "find_unused": {"find_unused_parameters": True}, "compiled": {}}


class TwoHeads(nn.Module):
    """The MLP with a second head that forward() never uses: its parameters never get a gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU())
        self.head, self.unused_head = nn.Linear(128, 10), nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.body(x))


def train_step(model, optimizer, images, labels, sync=True):
    with nullcontext() if sync else model.no_sync():  # no_sync: backward() skips the all-reduce
        with record_function("forward"):
            loss = nn.functional.cross_entropy(model(images), labels)
        with record_function("backward"):
            loss.backward()  # DDP all-reduces each gradient bucket as soon as it is ready
    with record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def unused_parameters(device, images, labels):
    """What DDP does with a parameter that gets no gradient: the error without the option, then the fixes."""
    found = {}
    for name, options in [("default", {}), ("find_unused_parameters", {"find_unused_parameters": True}),
                          ("static_graph", {"static_graph": True})]:
        torch.manual_seed(0)
        model = DDP(TwoHeads().to(device), **options)
        try:
            for _ in range(2):  # the error appears in the second step's forward
                nn.functional.cross_entropy(model(images), labels).backward()
            found[name] = "ok"
        except RuntimeError as error:
            found[name] = str(error).split(". ")[0] + "."
    return found


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "resnet18"], default="mlp")
    parser.add_argument("--configs", default="sync,no_sync", help=f"comma-separated, from: {', '.join(OPTIONS)}")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--image-size", type=positive_int, default=32, help="resnet18 input size in pixels")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per call, after 1 warm-up")
    parser.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (course.measure)")
    parser.add_argument("--trace", type=repo_path, help="also profile --trace-steps steps of the first config here")
    parser.add_argument("--trace-steps", type=positive_int, default=3)
    parser.add_argument("--unused-demo", action="store_true", help="with --model mlp: DDP and a parameter that gets no gradient")
    parser.add_argument("--run-dir", type=repo_path, default="runs/05_performance/step")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if unknown := set(configs) - set(OPTIONS):
        parser.error(f"unknown configuration(s) {', '.join(sorted(unknown))}; choose from {', '.join(OPTIONS)}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device))

    torch.manual_seed(rank)  # each rank its own batch, as with a DistributedSampler
    shape, classes = ((1, 28, 28), 10) if args.model == "mlp" else ((3, args.image_size, args.image_size), 5)
    images = torch.randn(args.batch_size, *shape, device=device)
    labels = torch.randint(classes, (args.batch_size,), device=device)
    ids = [device.index] if device.type != "cpu" else None

    def model_of(config):
        return "sync" if config == "no_sync" else config  # no_sync: the sync model, its all-reduce skipped

    models, counters, first_step = {}, {}, {}
    for name in dict.fromkeys(map(model_of, configs)):
        torch.manual_seed(0)
        model = DDP(build_model(args.model, classes).to(device), device_ids=ids, **OPTIONS[name])
        counters[name] = CommCounter()
        counters[name].register(model)
        model = torch.compile(model) if name == "compiled" else model
        models[name] = model, torch.optim.SGD(model.parameters(), lr=0.01)

    def seconds_per_step(config):
        """Median of --steps steps after one untimed warm-up step, on the slowest rank."""
        model, optimizer = models[model_of(config)]
        times = []
        for i in range(args.steps + 1):
            begin = time.perf_counter()
            train_step(model, optimizer, images, labels, sync=config != "no_sync")
            if device.type != "cpu":
                torch.accelerator.synchronize()
            (times if i else first_step.setdefault(config, [])).append(time.perf_counter() - begin)
        slowest = torch.tensor(statistics.median(times))
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()

    timing = compare({c: (lambda c=c: seconds_per_step(c)) for c in configs}, repeats=args.rounds,
                     unit="s/step", higher_is_better=False)
    per_config = {}
    for name in configs:
        (model, optimizer), counter = models[model_of(name)], counters[model_of(name)]
        counter.take()
        with nullcontext() if name != "no_sync" else model.no_sync():
            nn.functional.cross_entropy(model(images), labels).backward()  # one step, counted
        all_reduces, sent = counter.take()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        storages = {g.untyped_storage().data_ptr() for g in grads}  # gradients that share memory count once
        per_config[name] = {"all_reduces_per_step": all_reduces, "bytes_per_step": sent,
                            "first_step_s": first_step[name][0], "gradient_storages": len(storages)}
        optimizer.zero_grad(set_to_none=True)

    if args.trace:  # each rank writes its own Chrome trace: open it in Perfetto or chrome://tracing
        args.trace.mkdir(parents=True, exist_ok=True)
        model, optimizer = models[model_of(configs[0])]
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                     ) as prof:
            for _ in range(args.trace_steps):
                train_step(model, optimizer, images, labels, sync=configs[0] != "no_sync")
                if device.type != "cpu":
                    torch.accelerator.synchronize()
        prof.export_chrome_trace(str(args.trace / f"rank{rank}.json"))

    demo = unused_parameters(device, images, labels) if args.unused_demo and args.model == "mlp" else None
    params = sum(p.numel() for p in build_model(args.model, classes).parameters())
    if rank == 0:
        timing.show()
        for name, r in per_config.items():
            print(f"{name:<11} {r['all_reduces_per_step']} all-reduce(s), {r['bytes_per_step'] / 1e6:.2f} MB per step; "
                  f"first step {r['first_step_s']:.2f} s", flush=True)
        for name, outcome in (demo or {}).items():
            print(f"unused parameters, {name}: {outcome}", flush=True)
    RunLog(args.run_dir, enabled=rank == 0, script="perf_step", model=args.model, world_size=world_size,
           device=str(device), backend=backend_for(device), batch_per_rank=args.batch_size,
           image_size=args.image_size if args.model == "resnet18" else None, parameters=params,
           gradient_bytes=4 * params, threads=torch.get_num_threads()).finish(
        timing=timing.to_dict(), configs=per_config, unused_demo=demo,
        trace=str(args.trace) if args.trace else None)
    models.clear()
    gc.collect()  # free the DDP models first: otherwise gloo sometimes aborts at exit (torch 2.14, CPU)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
