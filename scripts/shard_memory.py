# Written by notebooks/08_sharding_fsdp.ipynb - edit it there; running the notebook rewrites this file.
"""What each rank holds, what it sends, and how long a step takes: DDP, ZeRO-1, ZeRO-2-like and FSDP2.

For each strategy the same seeded model is wrapped, given Adam, and trained 3 steps on random data. After
the forward of the 3rd step (the 2nd step's gradients are still there: the loop zeroes them after the
forward) every rank sums the storage of its parameters, gradients and optimizer state, and of what autograd
saved for backward (the activations); the collectives of that step are counted. Then DDP and FSDP2 are
timed against each other, interleaved and repeated, and each collective alone at the model's size.

    torchrun --standalone --nproc-per-node=2 scripts/shard_memory.py --model resnet18
"""
import argparse
import gc
import os
import statistics
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from course.args import JobParser, nonnegative_int, positive_int, repo_output_dir
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.measure import compare, time_call
from course.models import build_model
from course.runlog import RunLog
from course.sharding import STRATEGIES, CollectiveCounter, blocks, local_bytes, optimizer_tensors, storage


def wrap(strategy, model, device, mesh, bf16):
    """The model and its Adam optimizer under one strategy; the optimizer is always made after wrapping."""
    if strategy in ("DDP", "ZeRO-1"):
        model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
        if strategy == "DDP":
            return model, torch.optim.Adam(model.parameters(), lr=1e-3)
        # ZeRO-1: each rank keeps Adam's state for its own subset of the (whole) parameters, updates those
        # after DDP's all-reduce, then broadcasts them to the other ranks.
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    mp = MixedPrecisionPolicy()  # fp32; with bf16: gathered and computed in bf16, gradients reduced in fp32
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = strategy == "FSDP2"  # ZeRO-2-like: the gathered parameters stay from forward to backward
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def step(model, optimizer, images, labels, bf16, after_forward=None):
    """One training step in train_ddp.py's order: forward, zero_grad, backward, optimizer step."""
    with torch.autocast(images.device.type, torch.bfloat16, enabled=bf16 and isinstance(model, DDP)):
        output = model(images)  # (FSDP2 casts through its mixed-precision policy instead of autocast)
    if after_forward:
        after_forward()
    loss = nn.functional.cross_entropy(output.float(), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if images.device.type != "cpu":
        torch.accelerator.synchronize()  # so that a timed step includes the work it queued


def measure(strategy, args, device, mesh, batch, world_size):
    """Bytes held after the forward of step 3, its activations and collectives, the accelerator's peak."""
    torch.manual_seed(0)
    model = build_model(args.model, args.classes).to(device)
    psi = sum(p.numel() for p in model.parameters())
    model, optimizer = wrap(strategy, model, device, mesh, args.bf16)
    own = list(model.parameters())  # what the optimizer updates: whole tensors, or this rank's shards (FSDP2)
    held, saved = {}, []

    def count():  # between forward and zero_grad
        whole = list(model.parameters())  # the gathered parameters, where they are kept (ZeRO-2-like)
        weights = {storage(p).data_ptr() for p in whole + own}
        held.update(parameters=local_bytes(whole + own), gradients=local_bytes(p.grad for p in own),
                    optimizer=local_bytes(optimizer_tensors(optimizer)),
                    activations=local_bytes(saved, exclude=weights))  # saved weights are not activations
        saved.clear()

    accelerator = device.type != "cpu"
    for i in range(3):
        last = i == 2
        if last and accelerator:
            torch.accelerator.reset_peak_memory_stats()
            start = torch.accelerator.memory_allocated()
        counter = CollectiveCounter() if last else nullcontext()
        keep = (lambda t: saved.append(t) or t) if last else (lambda t: t)  # what autograd saves for backward
        with counter, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            step(model, optimizer, *batch, args.bf16, after_forward=count if last else None)
    result = {"psi": psi, **held, "collectives": counter.summary(world_size)}
    if isinstance(model, DDP):  # DDP's gradient buckets: allocated once, kept for the whole run
        sizes = str(model._get_ddp_logging_data().get("rebuilt_bucket_sizes", ""))
        result["ddp_bucket_bytes"] = sum(int(b) for b in sizes.split(", ") if b)
    if accelerator:
        result.update(allocated_before_step=start, peak_allocated_in_step=torch.accelerator.max_memory_allocated())
    return result  # the model and optimizer go with this function's frame


def collective_seconds(nbytes, world_size, device, rounds):
    """Median seconds of one all-reduce, all-gather and reduce-scatter of ``nbytes`` in fp32."""
    n = -(-nbytes // 4 // world_size) * world_size  # a multiple of the world size
    whole, part = torch.ones(n, device=device), torch.ones(n // world_size, device=device)
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)
    calls = {"all-reduce": lambda: (dist.all_reduce(whole), sync()),
             "all-gather": lambda: (dist.all_gather_single(whole, part), sync()),
             "reduce-scatter": lambda: (dist.reduce_scatter_single(part, whole), sync())}
    return {name: statistics.median(time_call(fn, repeats=rounds, warmup=1)) for name, fn in calls.items()}


@record
def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet18"], default="resnet18")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="per rank")
    parser.add_argument("--image-size", type=positive_int, default=32, help="cnn and resnet18 inputs")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute: autocast (DDP, ZeRO-1), FSDP2's policy")
    parser.add_argument("--time-steps", type=nonnegative_int, default=3, help="steps per timed round (0: no timing)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="timed rounds of DDP and FSDP2")
    parser.add_argument("--run-dir", type=repo_output_dir, default="runs/shard_memory")
    args = parser.parse_args()
    args.classes = 10 if args.model == "mlp" else 5

    world_size = parser.world_size()  # outside torchrun: one line saying how to launch it
    rank = int(os.environ["RANK"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    with reported_once(rank):
        log = RunLog(args.run_dir, enabled=rank == 0, script="shard_memory", world_size=world_size,
                     device=str(device), model=args.model, batch_per_rank=args.batch_size, bf16=args.bf16)
    dist.init_process_group(backend_for(device))
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(1 + rank)  # each rank its own random batch
    shape = (1, 28, 28) if args.model == "mlp" else (3, args.image_size, args.image_size)
    batch = (torch.randn(args.batch_size, *shape, device=device),
             torch.randint(0, args.classes, (args.batch_size,), device=device))

    measured = {}
    for strategy in STRATEGIES:
        mine = measure(strategy, args, device, mesh, batch, world_size)
        gc.collect()  # the last strategy's tensors are freed before the next one is measured
        if device.type != "cpu":
            torch.accelerator.empty_cache()
        measured[strategy] = [None] * world_size
        dist.all_gather_object(measured[strategy], mine)  # rank 0 reports every rank's numbers
        if rank == 0:
            held = [sum(r[k] for k in ("parameters", "gradients", "optimizer")) / 1e6 for r in measured[strategy]]
            print(f"{strategy:>11}: {' / '.join(f'{h:.1f}' for h in held)} MB held by ranks 0..{world_size - 1}",
                  flush=True)
    psi = measured["DDP"][0]["psi"]

    timing = {}
    if args.time_steps:
        models = {}
        for strategy in ("DDP", "FSDP2"):
            torch.manual_seed(0)
            models[strategy] = wrap(strategy, build_model(args.model, args.classes).to(device), device, mesh,
                                    args.bf16)

        def seconds_per_step(strategy):
            def once():
                step(*models[strategy], *batch, args.bf16)
            return lambda: statistics.median(time_call(once, repeats=args.time_steps, warmup=0))

        # Every rank runs the same sequence (their collectives must match); rank 0's clock is reported.
        speed = compare({"DDP": seconds_per_step("DDP"), "FSDP2": seconds_per_step("FSDP2")},
                        repeats=args.rounds, warmup=1, unit="s/step", higher_is_better=False)
        timing = {"comparison": speed.to_dict(), "verdict": speed.verdict("FSDP2", "DDP"),
                  "collective_seconds": collective_seconds(4 * psi, world_size, device, args.rounds + 1)}
        if rank == 0:
            print(speed.table(), flush=True)
    log.finish(psi=psi, groups=len(blocks(build_model(args.model, args.classes))) + 1, measured=measured,
               timing=timing)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
