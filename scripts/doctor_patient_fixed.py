# Written by notebooks/09b_check_your_script.ipynb - edit it there; running the notebook rewrites this file.
"""doctor_patient.py with its three mistakes fixed, each change marked with its number (notebook 09b).

    torchrun --standalone --nproc-per-node=2 scripts/doctor_patient_fixed.py --epochs 2
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.data import build_datasets
from course.hardware import backend_for, pick_device
from course.models import build_model


@torch.no_grad()
def evaluate(model, loader, device):
    """[correct, total] over the loader."""
    counts = torch.zeros(2, device=device)
    for images, labels in loader:
        predicted = model(images.to(device)).argmax(1)
        counts += torch.tensor([(predicted == labels.to(device)).sum().item(), len(labels)], device=device)
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="weights/doctor_patient.pt")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    dist.init_process_group(backend_for(device))
    train_set, val_set, classes = build_datasets("mnist")
    sampler = DistributedSampler(train_set, seed=0)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), dist.get_world_size())), 500)  # fix 2
    torch.manual_seed(0)
    model = DDP(build_model("mlp", classes).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # fix 1: a new order every epoch, the same on every rank
        model.train()
        for images, labels in train_loader:
            loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        counts = evaluate(model.module, val_loader, device)
        dist.all_reduce(counts)  # fix 2: every rank's shard counted, once
        correct, total = counts.tolist()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f}, val accuracy {correct / total:.3f} ({int(total)} samples)")
        if rank == 0:  # fix 3: one writer, rank 0
            torch.save(model.module.state_dict(), args.checkpoint)
    dist.barrier()  # every rank done before any leaves
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
