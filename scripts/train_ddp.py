"""Train a classifier with DistributedDataParallel: train_single.py plus the five DDP steps.

    torchrun --standalone --nproc-per-node=2 scripts/train_ddp.py                    # MLP, MNIST-shaped set
    torchrun --standalone --nproc-per-node=2 scripts/train_ddp.py --dataset flowers  # small CNN, flowers
"""
import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

from course.checkpoint import save_checkpoint
from course.data import DatasetError, build_datasets
from course.hardware import backend_for, pick_device
from course.models import DEFAULT_MODEL, build_model
from course.runlog import RunLog

NAME = Path(__file__).stem


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["mnist", "flowers"], default="mnist")
    parser.add_argument("--data-dir", help="use a real dataset at this path instead of the generated one")
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet18"], help="default: mlp (mnist), cnn (flowers)")
    parser.add_argument("--image-size", type=int, default=64, help="flowers only: images are resized to this")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step, per process (DDP step 4)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="steps between logged losses")
    parser.add_argument("--run-dir", default=f"runs/{NAME}", help="TensorBoard events and metrics.json")
    parser.add_argument("--checkpoint", default=f"weights/{NAME}.pt")
    return parser.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    """[correct, total] over the loader, as a tensor (so that it can be summed across processes)."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        counts += torch.stack([(model(images).argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)])
    model.train()
    return counts


@record  # under torchrun, a crash shows this process's traceback instead of "error_file: <N/A>"
def main():
    args = parse_args()
    # DDP step 1: join the process group. torchrun sets these variables for every process it starts.
    rank = int(os.environ["RANK"])  # global: unique across all machines; decides who logs and saves
    local_rank = int(os.environ["LOCAL_RANK"])  # on this machine only: decides which device
    world_size = int(os.environ["WORLD_SIZE"])
    # DDP step 2: bind the process to its own device *before* anything touches a GPU (cpu without GPUs).
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device))  # DDP step 1: nccl for GPUs, gloo for CPUs
    torch.manual_seed(args.seed)  # the same initial weights on every run

    try:
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
    except DatasetError as error:
        raise SystemExit(f"error: {error}")
    # DDP step 4: each rank reads its own 1/world_size of the data (same seeded permutation, every
    # world_size-th index); validation is split without padding so that no image is counted twice.
    sampler = DistributedSampler(train_set, seed=args.seed)
    val_set = Subset(val_set, range(rank, len(val_set), world_size))
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    val_loader = DataLoader(val_set, 256, num_workers=args.workers)

    model = build_model(args.model or DEFAULT_MODEL[args.dataset], num_classes).to(device)
    # DDP step 3: wrap. DDP copies rank 0's weights to every rank, then averages gradients in backward().
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()  # has no parameters or buffers: nothing to move to the device

    # DDP step 5: only rank 0 writes logs, metrics and checkpoints. The global batch is per-rank x ranks.
    log = RunLog(args.run_dir, enabled=rank == 0, script=NAME, world_size=world_size,
                 backend=dist.get_backend(), device=str(device), batch_per_rank=args.batch_size,
                 global_batch=args.batch_size * world_size, lr=args.lr,
                 dataset=args.dataset, model=args.model or DEFAULT_MODEL[args.dataset])
    if rank == 0:  # DDP step 5
        print(f"{NAME}: {len(train_set)} training samples, {world_size} ranks, batch {args.batch_size} per rank "
              f"= global batch {args.batch_size * world_size}", flush=True)
    print(f"rank {rank} (local rank {local_rank}) on {device}", flush=True)

    step, samples, train_seconds, train_loss = 0, 0, 0.0, float("nan")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP step 4: a new shuffle each epoch (same on every rank)
        epoch_start = time.perf_counter()
        for images, labels in tqdm(train_loader, desc=f"epoch {epoch}", mininterval=3, ncols=90,
                                   disable=rank != 0):  # DDP step 5
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            samples += len(labels)
            if step % args.log_every == 0 or step == args.max_steps:
                # DDP step 5: log the mean over all ranks, not rank 0's share of the batch alone.
                batch_loss = loss.detach().clone()
                dist.all_reduce(batch_loss)
                train_loss = batch_loss.item() / world_size
                log.scalar("train/loss", train_loss, step)
            if step == args.max_steps:
                break
        train_seconds += time.perf_counter() - epoch_start

        counts = evaluate(model, val_loader, device)
        dist.all_reduce(counts)  # DDP step 5: exact global accuracy = summed counts of all ranks
        correct, total = counts.tolist()
        log.scalar("val/accuracy", correct / total, step)
        if rank == 0:  # DDP step 5: one writer; save the unwrapped model, so keys carry no "module." prefix
            print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
                  f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
            save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "epoch": epoch, "step": step}, args.checkpoint)
        if step == args.max_steps:
            break

    metrics = log.finish(steps=step, samples_per_s=samples * world_size / train_seconds,  # DDP step 5: all ranks
                         final_train_loss=train_loss, val_accuracy=correct / total, val_correct=correct,
                         val_total=total)
    if rank == 0:  # DDP step 5
        print(f"done: {metrics['samples_per_s']:.0f} samples/s, val accuracy {metrics['val_accuracy']:.4f}",
              flush=True)
    dist.destroy_process_group()  # DDP step 1: leave the group cleanly


if __name__ == "__main__":
    main()
