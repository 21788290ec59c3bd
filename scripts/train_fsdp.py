# Written by notebooks/08_sharding_fsdp.ipynb - edit it there; running the notebook rewrites this file.
"""Train a classifier with FSDP2 (fully_shard): train_ddp.py with the model sharded across the ranks.

Each rank keeps 1/world_size of every parameter, gradient and optimizer state; whole parameters exist only
for the block being computed. Every change from train_ddp.py is marked "FSDP step N" (notebook 08).

    torchrun --standalone --nproc-per-node=2 train_fsdp.py                    # MLP, MNIST-shaped set
    torchrun --standalone --nproc-per-node=2 train_fsdp.py --dataset flowers  # small CNN, flowers

To take it home, copy these four files beside it: course/__init__.py (empty), course/data.py and course/models.py
(your data and model code: replace them), course/train_utils.py. It needs torch, torchvision, tqdm and
tensorboard, nothing else. Relative paths (--run-dir, --checkpoint) are relative to the working directory.
"""
import argparse
import os
import time
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
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from course.data import DatasetError, build_datasets
from course.models import DEFAULT_MODEL, blocks, build_model
from course.train_utils import (
    CourseError,
    StepTimer,
    check_writable,
    fail,
    number,
    pick_device_and_backend,
    record,
    save_json,
    seed,
    write_manifest,
)

NAME = Path(__file__).stem


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["mnist", "flowers"], default="mnist")
    parser.add_argument("--data-dir", help="the dataset's folder (in the course: default, the generated one)")
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet18"], help="default: mlp (mnist), cnn (flowers)")
    parser.add_argument("--image-size", type=number(int, 0), default=64, help="flowers only: resized to this")
    parser.add_argument("--epochs", type=number(int, 0), default=3)
    parser.add_argument("--max-steps", type=number(int, 0, False), default=0, help="stop after this many steps (0: none)")
    parser.add_argument("--batch-size", type=number(int, 0), default=64, help="samples per step, per process (DDP step 4)")
    parser.add_argument("--lr", type=number(float, 0.0), default=0.05)
    parser.add_argument("--workers", type=number(int, 0, False), default=0, help="DataLoader worker processes")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--log-every", type=number(int, 0), default=10, help="steps between logged losses")
    parser.add_argument("--warmup-steps", type=number(int, 0, False), default=3, help="first steps left out of samples/s")
    parser.add_argument("--run-dir", type=Path, default=Path("runs", NAME), help="TensorBoard events, metrics.json")
    # FSDP step 5: a checkpoint is a folder: one file per rank, and metadata saying where each piece goes.
    parser.add_argument("--checkpoint", type=Path, default=Path("weights", NAME), help="a folder (DCP)")
    # FSDP step 2: free each block's gathered parameters after its forward (gather them again in backward).
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    # FSDP step 3: bf16 compute with fp32 gradient reduction; default: on where the accelerator has bf16 units.
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
    start = time.time()
    # DDP step 1: torchrun starts one process per device and tells each who it is (plain python: one process).
    torchrun = "RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))  # global: unique across all machines; decides who logs and saves
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # on this machine only: decides which device
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # how many processes in all
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # how many on this machine
    # DDP step 2: bind the process to its own device *before* anything touches it (cpu without accelerators).
    device, backend = pick_device_and_backend(local_rank, local_world_size)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    torch.manual_seed(args.seed)  # the same initial weights on every run
    # FSDP step 3: a CPU has no fast bf16, nor has a GPU that only emulates it (V100, T4: including_emulation=False)
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    bf16 = (native_bf16 or device.type not in ("cpu", "cuda")) if args.bf16 is None else args.bf16

    # Whatever can be wrong with the input is found before training starts: one "error: ..." line, exit 2.
    try:  # DDP step 5: checked on every rank before the process group exists, so every rank stops
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
        check_writable(args.checkpoint / ".metadata")  # FSDP step 5: the folder, before any training
        check_writable(args.run_dir / "metrics.json", "the run directory")  # and TensorBoard's
    except (DatasetError, CourseError) as error:
        fail(error)
    writer = SummaryWriter(args.run_dir) if rank == 0 else None  # DDP step 5: TensorBoard events, one writer
    if torchrun:  # DDP step 1: join the others (nccl for GPUs, gloo for CPUs)
        dist.init_process_group(backend)
    else:  # DDP step 1: `python train_ddp.py`: a group of this one process (no torchrun to meet the others at)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
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

    model_name = args.model or DEFAULT_MODEL[args.dataset]
    model = build_model(model_name, num_classes).to(device)
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
    criterion = nn.CrossEntropyLoss().to(device)  # moves nothing here; a weighted loss holds a tensor to move

    if rank == 0:  # DDP step 5
        print(f"{NAME}: {len(train_set)} training samples, {world_size} ranks, batch {args.batch_size} per rank "
              f"= global batch {args.batch_size * world_size}", flush=True)
    print(f"rank {rank} (local rank {local_rank}) on {device}", flush=True)

    # Steady-state speed: the first steps (allocation, caches) are not timed, nor is evaluation; a GPU runs
    # ahead of Python, so each timed step waits for it.
    timer = StepTimer(args.warmup_steps, torch.accelerator.synchronize if device.type != "cpu" else None)
    running = torch.zeros(2, device=device)  # [sum of losses, steps] since the last logged loss
    step, train_loss, history = 0, float("nan"), []
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
                if rank == 0:  # DDP step 5
                    writer.add_scalar("train/loss", train_loss, step)
                    history.append((step, train_loss))
            timer.tick(len(labels))

        counts = evaluate(model, val_loader, device)
        dist.all_reduce(counts)  # DDP step 5: exact global accuracy = summed counts of all ranks
        correct, total = counts.tolist()
        if rank == 0:  # DDP step 5: one writer (FSDP step 5: but every rank saves its shards, below)
            writer.add_scalar("val/accuracy", correct / total, step)
            print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
                  f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        # FSDP step 5: every rank writes its own shards, in parallel, and no rank ever holds the whole model.
        # get_state_dict names each tensor as in the plain model ("1.weight"), so the folder loads on any
        # number of ranks and converts to one ordinary file (fsdp_checkpoint.py). DCP writes the metadata last.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "epoch": torch.tensor(epoch), "step": torch.tensor(step)},
                 checkpoint_id=args.checkpoint)
        dist.barrier()  # FSDP step 5: every rank's pieces on disk, then their checksums (DCP keeps none)
        if rank == 0:
            write_manifest(args.checkpoint)
        if step == args.max_steps:
            break

    metrics = {"script": NAME, "world_size": world_size, "backend": backend, "device": str(device),
               "batch_per_rank": args.batch_size, "global_batch": args.batch_size * world_size, "lr": args.lr,
               "dataset": args.dataset, "model": model_name,
               "reshard_after_forward": args.reshard_after_forward, "bf16": bf16,  # FSDP step 2 and 3: as used
               "steps": step,
               **timer.summary(world_size),  # DDP step 5: samples/s summed over the ranks
               "final_train_loss": train_loss, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "wall_time_s": round(time.time() - start, 3), "train_loss_history": history}
    if rank == 0:  # DDP step 5
        writer.close()
        save_json(metrics, args.run_dir / "metrics.json")  # atomically: a reader never sees half a file
        print(f"done: {timer.line(world_size)}, val accuracy {correct / total:.4f}", flush=True)
    dist.barrier()  # DDP step 1: every rank done before any leaves (gloo needs it: notebook 03)
    dist.destroy_process_group()  # DDP step 1: leave the group cleanly


if __name__ == "__main__":
    main()
