# Written by notebooks/04_pitfalls.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfalls 1 and 3 of notebook 04: which device each rank uses, and tensors left on another device.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_device.py                    # correct
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_device.py --bug loss-weight  # class weights
    torchrun ... scripts/pitfall_device.py --bug plain-attribute  # a tensor that model.to() does not move
    torchrun ... scripts/pitfall_device.py --bug set-device       # GPU: no set_device, every rank on GPU 0
    torchrun ... scripts/pitfall_device.py --bug set-device --backend gloo  # the same, with gloo
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.errors import record
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
    parser.add_argument("--backend", choices=["auto", "gloo"], default="auto",
                        help="auto: the device's own backend (nccl on NVIDIA GPUs)")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])

    if args.bug == "set-device":
        if not torch.accelerator.is_available():
            raise SystemExit("--bug set-device needs a GPU: without one there is no GPU 0 to crowd onto")
        device = torch.device(torch.accelerator.current_accelerator().type)  # BUG: no index, no set_device
    else:
        device = pick_device(local_rank)
        if device.type != "cpu":
            torch.accelerator.set_device_index(device.index)  # torch.cuda.set_device: before any GPU work
    backend = backend_for(device) if args.backend == "auto" else args.backend
    dist.init_process_group(backend, timeout=timedelta(seconds=60))

    model = Net(bug=args.bug == "plain-attribute").to(device)
    # The per-rank device check: run it first thing in a new job. Each GPU rank must show its own device.
    current = torch.accelerator.current_device_index() if device.type != "cpu" else "n/a (CPU)"
    print(f"rank {rank} (local rank {local_rank}, {backend}): parameters on {next(model.parameters()).device}, "
          f"current GPU index {current}", flush=True)
    # Construction broadcasts rank 0's parameters and buffers: the job's first collective.
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
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
