# Reference solution of exercise 1 of notebooks/09_build_it_yourself.ipynb: look after you have tried.
"""Exercise 1: classify noisy waveforms with a small 1-D CNN, with DistributedDataParallel.

    torchrun --standalone --nproc-per-node=2 scripts/ex1_convert.py --batch-size 16

--batch-size is per process: 2 processes x 16 = the global batch 32 of ex1_single.py.
Writes <out>/log.jsonl (the loss of every step, then the validation counts) and <out>/model.pt, from one
process.
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
    # DDP step 1: torchrun gives every process its rank, its local rank (on this machine) and the world size.
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    # Step 2's tools (notebook 03's train_ddp.py uses them inline, step 2):
    # torch.accelerator.current_accelerator() (cuda, mps, ... or None), torch.accelerator.device_count(),
    # torch.accelerator.set_device_index(i), dist.get_default_backend_for_device(accelerator) (nccl for cuda) and
    # dist.Backend.backend_capability (the device types a backend carries); MPS cannot be carried between
    # processes, so there (and with no accelerator, or fewer than the processes) the CPU and gloo.
    # DDP step 2: one device per process, chosen before anything touches it.
    accelerator = torch.accelerator.current_accelerator()  # cuda, xpu, mps, ... or None
    backend = dist.get_default_backend_for_device(accelerator) if accelerator else "gloo"
    if accelerator and accelerator.type in dist.Backend.backend_capability.get(backend, ()) \
            and torch.accelerator.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))  # DDP step 1: join the others
    torch.manual_seed(args.seed)  # the same initial weights on every run
    train_set, val_set = wave_datasets()
    # DDP step 4: each rank reads every world_size-th index of the same seeded permutation, so that the
    # ranks' batches of a step together are the single-device script's batch. Validation: split, no padding.
    sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 100)

    model = DDP(WaveNet().to(device))  # DDP step 3: rank 0's weights everywhere; gradients averaged
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    history = []  # what the log will hold: one record per step, then the validation counts
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP step 4: a new order each epoch (seed + epoch), the same on every rank
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            summed = loss.detach().clone()
            dist.all_reduce(summed)  # DDP step 5: log the loss of the global batch, not this rank's half
            global_loss = summed.item() / world_size
            history.append({"step": step, "epoch": epoch, "loss": global_loss})
            step += 1
    counts = evaluate(model, val_loader, device)
    dist.all_reduce(counts)  # DDP step 5: every rank counted its own part; the sum counts each sample once
    correct, total = counts.tolist()
    history.append({"val_correct": correct, "val_total": total})

    if rank == 0:  # DDP step 5: one process writes the log and the checkpoint (the unwrapped model)
        with open(out / "log.jsonl", "w") as log:
            log.writelines(json.dumps(record) + "\n" for record in history)
        torch.save(model.module.state_dict(), out / "model.pt")
        print(f"{step} steps, last loss {history[-2]['loss']:.4f}, val accuracy {correct / total:.3f} "
              f"({correct}/{total}); saved {out / 'model.pt'}")
    dist.barrier()  # DDP step 1: every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()  # DDP step 1: leave the group


if __name__ == "__main__":
    main()
