# Written by notebooks/09_build_it_yourself.ipynb - edit it there; running the notebook rewrites this file.
"""Exercise 1, the starting point: classify noisy waveforms with a small 1-D CNN, on one device.

    python scripts/ex1_single.py --out runs/09_build_it_yourself/ex1_single

Writes <out>/log.jsonl (the loss of every step, then the validation counts) and <out>/model.pt.
"""
import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from course.exercise_tasks import WaveNet, wave_datasets
from course.hardware import pick_device


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex1_single")
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
    device = pick_device()
    torch.manual_seed(args.seed)  # the same initial weights on every run
    train_set, val_set = wave_datasets()
    order = torch.Generator()  # reseeded each epoch: a new order every epoch, the same on every run
    train_loader = DataLoader(train_set, args.batch_size, sampler=RandomSampler(train_set, generator=order))
    val_loader = DataLoader(val_set, 100)

    model = WaveNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    history = []  # what the log will hold: one record per step, then the validation counts
    step = 0
    for epoch in range(args.epochs):
        order.manual_seed(args.seed + epoch)
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history.append({"step": step, "epoch": epoch, "loss": loss.item()})
            step += 1
    correct, total = evaluate(model, val_loader, device).tolist()
    history.append({"val_correct": correct, "val_total": total})

    with open(out / "log.jsonl", "w") as log:
        log.writelines(json.dumps(record) + "\n" for record in history)
    torch.save(model.state_dict(), out / "model.pt")
    print(f"{step} steps, last loss {history[-2]['loss']:.4f}, val accuracy {correct / total:.3f} "
          f"({correct}/{total}); saved {out / 'model.pt'}")


if __name__ == "__main__":
    main()
