# Written by notebooks/04b_pitfalls_reference.ipynb - edit it there; running the notebook rewrites this file.
"""GradScaler under DDP (notebook 04b): every rank has its own scaler, and DDP never synchronises it.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_grad_scaler.py
Runs twice: every rank restores the same scaler state (correct), then only rank 0 does (the bug).
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.errors import record
from course.hardware import backend_for, pick_device


def train(device, rank, restored_on_every_rank: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1).to(device)
    # Created before DDP on purpose: the scaler never sees the model, so the order does not matter.
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    if restored_on_every_rank or rank == 0:  # BUG when only rank 0 restores it
        scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**10})  # as if resumed from a checkpoint
    model = DDP(model, device_ids=[device.index] if device.index is not None else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for step in range(3):
        loss = model(torch.randn(16, 8, generator=generator).to(device)).pow(2).mean()
        if step == 1 and rank == 1:
            loss = loss * float("inf")  # an overflow on rank 1 only
        optimizer.zero_grad()
        scaler.scale(loss).backward()  # DDP averages the *scaled* gradients of all ranks
        scaler.step(optimizer)  # skipped where the gradients hold inf/NaN
        scaler.update()  # halves the scale after a skipped step
        case = "every rank" if restored_on_every_rank else "rank 0 only"
        print(f"  [{case}] rank {rank} step {step}: scale {scaler.get_scale():.0f}", flush=True)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = weights.clone()
    dist.broadcast(reference, src=0)
    gap = (weights - reference).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"scaler restored on {'every rank' if restored_on_every_rank else 'rank 0 only'}: "
              f"largest weight difference between ranks {gap.item():.3g}", flush=True)


@record
def main():
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=60))
    for every_rank in (True, False):
        train(device, rank, every_rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
