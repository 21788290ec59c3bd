# Written by notebooks/04b_pitfalls_reference.ipynb - edit it there; running the notebook rewrites this file.
"""Check yourself (notebook 04b): a short DDP script with one hidden bug. Find it, fix it in the notebook.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_exercise.py
Trains the MNIST MLP for a few steps, then reports the validation accuracy (metrics.json) and saves the model.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.args import positive_int, repo_path
from course.checkpoint import check_writable, save_checkpoint
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.models import build_model
from course.runlog import RunLog


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument("--run-dir", type=repo_path, default="runs/04_pitfalls/exercise")
    parser.add_argument("--checkpoint", type=repo_path, default="weights/04_pitfalls_exercise.pt")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    with reported_once(rank):
        train_set, val_set, num_classes = build_datasets("mnist")
        check_writable(args.checkpoint)
        log = RunLog(args.run_dir, enabled=rank == 0)
    dist.init_process_group(backend_for(device))
    world_size = dist.get_world_size()

    torch.manual_seed(0)
    sampler = DistributedSampler(train_set, seed=0)
    loader = DataLoader(train_set, 64, sampler=sampler)
    model = DDP(build_model("mlp", num_classes).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _, (images, labels) in zip(range(args.steps), loader):
        loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    model.eval()
    val_part = Subset(val_set, range(rank, len(val_set), world_size))  # each rank: every world_size-th image
    with torch.no_grad():
        counts = sum(torch.stack([(model(x.to(device)).argmax(1) == y.to(device)).sum(),
                                  torch.tensor(len(y), device=device)]) for x, y in DataLoader(val_part, 1000))
    correct, total = counts.tolist()
    if rank == 0:
        save_checkpoint({"model": model.module.state_dict()}, args.checkpoint)
        print(f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
    log.finish(val_accuracy=correct / total, val_correct=correct, val_total=total, world_size=world_size)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
