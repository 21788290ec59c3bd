"""Pitfalls 1 and 3 of notebook 04: which device each rank uses, and tensors left on another device.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_device.py                    # correct
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_device.py --bug loss-weight  # class weights
    torchrun ... scripts/pitfall_device.py --bug plain-attribute  # a tensor that model.to() does not move
    torchrun ... scripts/pitfall_device.py --bug set-device       # 2+ GPUs: no set_device, all on cuda:0
"""
import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from course.hardware import backend_for, pick_device

# Where the forgotten tensor lives. With GPUs: the CPU, where torch creates every tensor by default.
# A CPU-only machine has no second real device, so there the bug uses "meta" (a device with shapes, no data).
STRAY = "cpu" if torch.accelerator.is_available() else "meta"


class Net(nn.Module):
    def __init__(self, bug: bool = False):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        if bug:
            self.scale = torch.full((4,), 0.5, device=STRAY)  # BUG: a plain attribute; model.to() skips it
        else:
            self.register_buffer("scale", torch.full((4,), 0.5))  # a buffer: moved by .to(), saved, synced

    def forward(self, x):
        return self.fc(x) * self.scale


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", choices=["none", "set-device", "loss-weight", "plain-attribute"], default="none")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])

    if args.bug == "set-device":
        if torch.accelerator.device_count() < 2:
            raise SystemExit("--bug set-device needs 2 or more GPUs")
        device = torch.device("cuda")  # BUG: no index and no set_device: every rank uses cuda:0
    else:
        device = pick_device(local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before anything touches the GPU
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=60))

    model = Net(bug=args.bug == "plain-attribute").to(device)
    # The per-rank device check: run it first thing in a new job. Each GPU rank must show its own device.
    cuda_now = torch.cuda.current_device() if torch.cuda.is_available() else "n/a (no GPU)"
    print(f"rank {rank} (local rank {local_rank}): parameters on {next(model.parameters()).device}, "
          f"current CUDA device {cuda_now}", flush=True)
    model = DDP(model, device_ids=[device.index] if device.index is not None else None)

    class_weights = torch.tensor([1.0, 2.0, 1.0, 1.0], device=STRAY if args.bug == "loss-weight" else device)
    criterion = nn.CrossEntropyLoss(weight=class_weights)  # the weight becomes a buffer of the loss module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(32, 16, device=device), torch.randint(0, 4, (32,), device=device)
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"rank {rank}: 3 steps done on {device}, loss {loss.item():.3f}", flush=True)
    # Free DDP before its process group: otherwise gloo sometimes aborts at exit (torch 2.14, CPU) with
    # "terminate called without an active exception". DDP holds reference cycles, so collect them too.
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
