# Written by notebooks/08_sharding_fsdp.ipynb - edit it there; running the notebook rewrites this file.
"""Train a classifier with FSDP2 (fully_shard): train_ddp.py with the model sharded across the ranks.

Each rank keeps 1/world_size of every parameter, gradient and optimizer state; whole parameters exist only
for the block being computed. Every change from train_ddp.py is marked "FSDP step N" (notebook 08).

    torchrun --standalone --nproc-per-node=2 scripts/train_fsdp.py                    # MLP, MNIST-shaped set
    torchrun --standalone --nproc-per-node=2 scripts/train_fsdp.py --dataset flowers  # small CNN, flowers
"""
import argparse
import os
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

from course.args import nonnegative_int, positive_float, positive_int, repo_path
from course.checkpoint import check_writable
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.measure import StepTimer
from course.models import DEFAULT_MODEL, build_model
from course.runlog import RunLog
from course.sharding import blocks

NAME = Path(__file__).stem


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["mnist", "flowers"], default="mnist")
    parser.add_argument("--data-dir", help="use a real dataset at this path instead of the generated one")
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet18"], help="default: mlp (mnist), cnn (flowers)")
    parser.add_argument("--image-size", type=positive_int, default=64, help="flowers only: resized to this")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--max-steps", type=nonnegative_int, default=0, help="stop after this many steps (0: none)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="samples per step, per process (DDP step 4)")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--workers", type=nonnegative_int, default=0, help="DataLoader worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=positive_int, default=10, help="steps between logged losses")
    parser.add_argument("--warmup-steps", type=nonnegative_int, default=3, help="first steps left out of samples/s")
    parser.add_argument("--run-dir", type=repo_path, default=f"runs/{NAME}", help="TensorBoard events, metrics.json")
    # FSDP step 5: a checkpoint is a folder: one file per rank, and metadata saying where each piece goes.
    parser.add_argument("--checkpoint", type=repo_path, default=f"weights/{NAME}", help="a folder (DCP)")
    # FSDP step 2: free each block's gathered parameters after its forward (gather them again in backward).
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    # FSDP step 3: bf16 compute with fp32 gradient reduction; default: on accelerators, off on CPUs.
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, help="default: on for accelerators")
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
    # DDP step 1: torchrun starts one process per device and tells each who it is.
    rank = int(os.environ["RANK"])  # global: unique across all machines; decides who logs and saves
    local_rank = int(os.environ["LOCAL_RANK"])  # on this machine only: decides which device
    world_size = int(os.environ["WORLD_SIZE"])  # how many processes in all
    # DDP step 2: bind the process to its own device *before* anything touches it (cpu without accelerators).
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    torch.manual_seed(args.seed)  # the same initial weights on every run
    bf16 = device.type != "cpu" if args.bf16 is None else args.bf16  # FSDP step 3: a CPU has no fast bf16

    # Whatever can be wrong with the input is found before training starts: one "error: ..." line, exit 2.
    with reported_once(rank):  # DDP step 5: checked before the process group exists; rank 0 reports
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
        check_writable(args.checkpoint / ".metadata")  # FSDP step 5: the folder, before any training
        log = RunLog(args.run_dir, enabled=rank == 0, script=NAME, world_size=world_size,  # DDP step 5
                     backend=backend_for(device), device=str(device), batch_per_rank=args.batch_size,
                     global_batch=args.batch_size * world_size, lr=args.lr, dataset=args.dataset,
                     model=args.model or DEFAULT_MODEL[args.dataset],  # FSDP steps 2 and 3: what was used
                     reshard_after_forward=args.reshard_after_forward, bf16=bf16)
    dist.init_process_group(backend_for(device))  # DDP step 1: join the others (nccl for GPUs, gloo for CPUs)
    mesh = init_device_mesh(device.type, (world_size,))  # FSDP step 1: the ranks that share the shards
    # DDP step 4: each rank reads its own 1/world_size of the data (same seeded permutation, every
    # world_size-th index); validation is split without padding so that no image is counted twice.
    sampler = DistributedSampler(train_set, seed=args.seed)
    # FSDP step 6: every forward all-gathers parameters, so every rank must run as many forwards as the
    # others: each evaluates the same number of images (the last len(val_set) % world_size are left out).
    val_set = Subset(val_set, range(rank, len(val_set) - len(val_set) % world_size, world_size))
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    val_loader = DataLoader(val_set, 256, num_workers=args.workers)

    model = build_model(args.model or DEFAULT_MODEL[args.dataset], num_classes).to(device)
    mp = MixedPrecisionPolicy()  # FSDP step 3: fp32 throughout; with bf16 (accelerators), gather and compute
    if bf16:  # in bf16, reduce-scatter gradients in fp32; the optimizer updates the fp32 shards
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # FSDP step 1: shard block by block, then the root (what is left, e.g. a stem or a head). Each call makes
    # one group: its parameters are gathered in one all-gather just before its forward (and backward), its
    # gradients reduce-scattered in one call; so only one or two blocks are ever whole at a time. Every rank
    # built the same seeded model, and each keeps its own 1/world_size of each parameter (dim 0).
    for block in blocks(model):  # FSDP step 2: reshard_after_forward=False keeps them whole until backward
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=args.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # FSDP step 1: the root (kept whole from forward to backward)
    # FSDP step 4: create the optimizer after sharding: fully_shard replaced the parameters with their shards
    # (DTensors), so the optimizer, and its momentum, hold 1/world_size of each.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()  # has no parameters or buffers: nothing to move to the device

    if rank == 0:  # DDP step 5
        print(f"{NAME}: {len(train_set)} training samples, {world_size} ranks, batch {args.batch_size} per rank "
              f"= global batch {args.batch_size * world_size}", flush=True)
    print(f"rank {rank} (local rank {local_rank}) on {device}", flush=True)

    # Steady-state speed: the first steps (allocation, caches) are not timed, nor is evaluation.
    timer = StepTimer(args.warmup_steps, sync=torch.accelerator.synchronize if device.type != "cpu" else None)
    running = torch.zeros(2, device=device)  # [sum of losses, steps] since the last logged loss
    step, train_loss = 0, float("nan")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP step 4: a new shuffle each epoch (the same on every rank)
        # Only the steps this epoch runs, so that --max-steps ends the loop (and closes the bar at 100%).
        steps = min(len(train_loader), args.max_steps - step) if args.max_steps else len(train_loader)
        bar = tqdm(islice(train_loader, steps), f"epoch {epoch}", steps, mininterval=3, ncols=90, disable=rank != 0)  # DDP step 5
        timer.start()
        for i, (images, labels) in enumerate(bar):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones_like(loss.detach())])
            if step % args.log_every == 0 or i + 1 == steps:
                dist.all_reduce(running)  # DDP step 5: summed over ranks, so the logged loss is the global mean
                train_loss = (running[0] / running[1]).item()  # the mean of the steps since the last log
                running.zero_()
                log.scalar("train/loss", train_loss, step)
            timer.tick(len(labels))

        counts = evaluate(model, val_loader, device)
        dist.all_reduce(counts)  # DDP step 5: exact global accuracy = summed counts of all ranks
        correct, total = counts.tolist()
        log.scalar("val/accuracy", correct / total, step)
        if rank == 0:  # DDP step 5
            print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
                  f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        # FSDP step 5: every rank writes its own shards, in parallel, and no rank ever holds the whole model.
        # get_state_dict names each tensor as in the plain model ("1.weight"), so the folder loads on any
        # number of ranks and converts to one ordinary file (fsdp_checkpoint.py).
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "epoch": epoch, "step": step},
                 checkpoint_id=args.checkpoint)
        if step == args.max_steps:
            break

    metrics = log.finish(steps=step, **timer.summary(world_size),  # DDP step 5: samples/s summed over ranks
                         final_train_loss=train_loss, val_accuracy=correct / total, val_correct=correct,
                         val_total=total)
    rate, timed = metrics["samples_per_s"], metrics["timed_steps"]
    speed = f"{rate:.0f} samples/s ({timed} timed steps)" if rate is not None else "no step timed after the warm-up"
    if rank == 0:  # DDP step 5
        print(f"done: {speed}, val accuracy {metrics['val_accuracy']:.4f}", flush=True)
    dist.destroy_process_group()  # DDP step 1: leave the group cleanly


if __name__ == "__main__":
    main()
