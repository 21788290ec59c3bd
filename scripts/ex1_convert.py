# Written by notebooks/09_build_it_yourself.ipynb - edit it there; running the notebook rewrites this file.
# ruff: noqa: F401, F841, PIE790, RUF059 - a stub: some imports and names are used once you fill it in
"""Exercise 1: classify noisy waveforms with a small 1-D CNN, with DistributedDataParallel.

    torchrun --standalone --nproc-per-node=2 scripts/ex1_convert.py --batch-size 16

--batch-size is per process: 2 processes x 16 = the global batch 32 of ex1_single.py.
Writes <out>/log.jsonl (the loss of every step, then the validation counts) and <out>/model.pt, from one
process.
Replace each `...` marked `# TODO`: they are every line the conversion touches (notebook 03's five steps).
"""
import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.exercise_tasks import WaveNet, wave_datasets


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex1")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a rank waits for the others")
    return parser.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    """[correct, total] over the loader."""
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    return counts


def main():
    args = parse_args()
    rank, local_rank, world_size = ..., ..., ...  # TODO step 1: read them from torchrun's environment
    # Step 2's tools (notebook 03's train_ddp.py uses them inline, step 2):
    # torch.accelerator.current_accelerator() (cuda, mps, ... or None), torch.accelerator.device_count(),
    # torch.accelerator.set_device_index(i), dist.get_default_backend_for_device(accelerator) (nccl for cuda) and
    # dist.Backend.backend_capability (the device types a backend carries); MPS cannot be carried between
    # processes, so there (and with no accelerator, or fewer than the processes) the CPU and gloo.
    device = ...  # TODO step 2: its accelerator number local_rank if each process has one, else the CPU
    ...  # TODO step 1: join the group: that device's backend, timeout=timedelta(seconds=args.timeout)
    torch.manual_seed(args.seed)  # the same initial weights on every run
    train_set, val_set = wave_datasets()
    train_loader = ...  # TODO step 4: batches of args.batch_size, this rank's part of the seed + epoch order
    val_loader = ...  # TODO step 4: batches of 100 from this rank's own part of val_set, no sample twice

    model = ...  # TODO step 3: a WaveNet on the device, wrapped
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    history = []  # what the log will hold: one record per step, then the validation counts
    step = 0
    for epoch in range(args.epochs):
        ...  # TODO step 4: this epoch's order (seed + epoch), the same on every rank
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_loss = ...  # TODO step 5: the loss of the global batch (a float), not this rank's half
            history.append({"step": step, "epoch": epoch, "loss": global_loss})
            step += 1
    correct, total = ...  # TODO step 5: evaluate(model, val_loader, device), every rank's counts added up
    history.append({"val_correct": correct, "val_total": total})

    if ...:  # TODO step 5: one process writes the log and the checkpoint
        with open(out / "log.jsonl", "w") as log:
            log.writelines(json.dumps(record) + "\n" for record in history)
        torch.save(..., out / "model.pt")  # TODO step 5: the state_dict of the model inside the wrapper
        print(f"{step} steps, last loss {history[-2]['loss']:.4f}, val accuracy {correct / total:.3f} "
              f"({correct}/{total}); saved {out / 'model.pt'}")
    ...  # TODO step 1: leave the process group


if __name__ == "__main__":
    main()
