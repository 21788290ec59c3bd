# Written by notebooks/05_performance.ipynb - edit it there; running the notebook rewrites this file.
"""Mixed precision and gradient compression under DDP: which one changes the bytes DDP sends, and the loss.

    torchrun --standalone --nproc-per-node=2 scripts/perf_precision.py --steps 40

Trains the MLP on the digits four times, from the same initial weights on the same batches:
  fp32       no autocast; DDP all-reduces fp32 gradients
  autocast   torch.autocast: bf16 on CPUs (no scaler needed), fp16 with torch.amp.GradScaler on CUDA
  fp16_hook  fp32 training; the gradient buckets are all-reduced in fp16 (like fp16_compress_hook)
  bf16_hook  the same in bf16 (like bf16_compress_hook)
A counting communication hook (course.commhooks) records the all-reduces and bytes of every step;
metrics.json holds every loss curve (TensorBoard too: loss/<config>).
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import default_collate

from course.args import positive_float, positive_int, repo_path
from course.commhooks import CommCounter
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.models import mlp
from course.runlog import RunLog

CONFIGS = ("fp32", "autocast", "fp16_hook", "bf16_hook")


def train(config, device, batches, lr, seed, log):
    """Loss per step (mean over all ranks), all-reduces and bytes per step, and the dtypes seen."""
    torch.manual_seed(seed)
    model = DDP(mlp().to(device), device_ids=[device.index] if device.type != "cpu" else None)
    counter = CommCounter()
    counter.register(model, compress={"fp16_hook": "fp16", "bf16_hook": "bf16"}.get(config))
    # Autocast runs chosen ops in a 16-bit type; fp16 needs a GradScaler (its small gradients underflow),
    # bf16 has fp32's exponent range and does not. The parameters stay fp32 either way.
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    use_amp = config == "autocast"
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp and amp_dtype == torch.float16)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, counts = [], []
    for images, labels in batches:
        images, labels = images.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
            output = model(images)
            loss = nn.functional.cross_entropy(output, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP's all-reduce runs here, through the counting hook
        scaler.step(optimizer)
        scaler.update()
        counts.append(counter.take())
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)  # not a gradient: not counted by the hook
        losses.append(mean_loss.item() / dist.get_world_size())
        log.scalar(f"loss/{config}", losses[-1], len(losses))
    all_reduces, sent = counts[-1]  # the first step may differ: DDP rebuilds its buckets after it
    params = next(model.parameters())
    dtypes = {"output": str(output.dtype), "parameters": str(params.dtype), "gradients": str(params.grad.dtype)}
    return {"loss": losses, "all_reduces_per_step": all_reduces, "bytes_per_step": sent, "dtypes": dtypes}


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per rank")
    parser.add_argument("--lr", type=positive_float, default=0.1)
    parser.add_argument("--run-dir", type=repo_path, default="runs/05_performance/precision")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    params = sum(p.numel() for p in mlp().parameters())
    with reported_once(rank):  # a run directory in use or not writable: one line, before the process group
        log = RunLog(args.run_dir, enabled=rank == 0, script="perf_precision", world_size=world_size,
                     device=str(device), backend=backend_for(device), parameters=params, steps=args.steps)
    dist.init_process_group(backend_for(device))

    train_set, _, _ = build_datasets("mnist")
    # The same batches for every configuration: step s, rank r reads samples [(s*N + r)*B, (s*N + r + 1)*B).
    n, b = world_size, args.batch_size
    batches = [default_collate([train_set[i] for i in range((s * n + rank) * b, (s * n + rank + 1) * b)])
               for s in range(args.steps)]
    results = {}
    for config in CONFIGS:
        try:
            results[config] = train(config, device, batches, args.lr, seed=0, log=log)
        except TypeError as error:  # register_comm_hook refuses bf16 hooks on builds without CUDA + NCCL
            if config != "bf16_hook":
                raise
            results[config] = {"unavailable": str(error)}
    reference = results["fp32"]["loss"]
    lines = [f"{'config':<10} {'all-reduces':>11} {'bytes/step':>10} {'bytes/param':>11} {'max |loss - fp32|':>17}"]
    for config, r in results.items():
        if "unavailable" in r:
            lines.append(f"{config:<10} unavailable in this build: {r['unavailable']}")
            continue
        r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["loss"], reference))
        r["bytes_per_param"] = r["bytes_per_step"] / params
        lines.append(f"{config:<10} {r['all_reduces_per_step']:>11} {r['bytes_per_step']:>10} "
                     f"{r['bytes_per_param']:>11.1f} {r['max_loss_diff']:>17.4f}")
    if rank == 0:
        print("\n".join(lines), flush=True)
    log.finish(results=results)  # metrics.json; TensorBoard shows the loss/* curves
    gc.collect()  # free the DDP models first: otherwise gloo sometimes aborts at exit (torch 2.14, CPU)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
