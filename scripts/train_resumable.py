# Written by notebooks/06_multinode_and_faults.ipynb - edit it there; running the notebook rewrites this file.
"""train_ddp.py that survives a crash: full checkpoints, exact resume, and a crash you can inject.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 train_resumable.py --resume
    COURSE_CRASH_AT_STEP=25 torchrun ... train_resumable.py --resume   # rank 1 crashes once at step 25

Every change from train_ddp.py is marked "resume step N" (notebook 06).

To take it home, copy these four files beside it: course/__init__.py (empty), course/data.py and course/models.py
(your data and model code: replace them), course/train_utils.py. It needs torch, torchvision, tqdm, tensorboard
and numpy, nothing else. Relative paths (--run-dir, --checkpoint) are relative to the working directory.
"""
import argparse
import os
import random
import time
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from course.data import DatasetError, build_datasets
from course.models import DEFAULT_MODEL, build_model
from course.train_utils import (
    CourseError,
    StepTimer,
    check_writable,
    fail,
    number,
    pick_device_and_backend,
    read_checkpoint,
    record,
    save_atomically,
    save_json,
    seed,
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
    parser.add_argument("--checkpoint", type=Path, default=Path("weights", f"{NAME}.pt"))
    # resume step 1: how often to save, whether to continue from the checkpoint, and a fault to inject.
    parser.add_argument("--save-every", type=number(int, 0), default=20, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    parser.add_argument("--crash-at-step", type=number(int, 0, False), default=os.environ.get("COURSE_CRASH_AT_STEP", "0"),
                        help="rank 1 raises after this step, first attempt only (0: never; or COURSE_CRASH_AT_STEP)")
    return parser.parse_args()


class ResumableSampler(DistributedSampler):  # resume step 3: skip what was trained on, without loading it
    """DistributedSampler that starts an epoch after its first ``skip`` samples (counted over all ranks)."""

    skip = 0

    def __iter__(self):  # the epoch's order padded for this world size; this rank takes every world_size-th
        return iter(list(super().__iter__())[self.skip // self.num_replicas:])

    def __len__(self):
        return super().__len__() - self.skip // self.num_replicas


def rng_state(loader_rng: torch.Generator) -> dict:  # resume step 1: every source of randomness
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "loader": loader_rng.get_state(), "python": random.getstate(),
            "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict, loader_rng: torch.Generator) -> None:  # resume step 3
    torch.set_rng_state(state["torch"].cpu())  # generator states are CPU tensors; map_location may have moved them
    loader_rng.set_state(state["loader"].cpu())
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def load_resume_state(path: Path, model: nn.Module, device: torch.device) -> dict:  # resume step 2
    """The checkpoint at ``path`` loaded into ``model`` (on this rank's own device); CourseError naming the
    file when it is corrupt, unsafe or made for another model. Nothing is written."""
    state = read_checkpoint(path, device)  # weights_only=True: tensors and plain data, never code
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "sampler_skip" not in state:
        raise CourseError(f"checkpoint {path} is not a {NAME}.py checkpoint (no model/sampler_skip entries)")
    mine, saved = model.state_dict(), state["model"]
    differ = sorted(set(mine) ^ set(saved)) + [k for k in mine if k in saved and mine[k].shape != saved[k].shape]
    if differ:  # another architecture or size: name the first tensor that differs
        k = differ[0]
        raise CourseError(f"checkpoint {path} was saved from a different model ({len(differ)} tensors differ; "
                          f"{k}: {tuple(saved[k].shape) if k in saved else 'absent'} in the file, "
                          f"{tuple(mine[k].shape) if k in mine else 'absent'} in this model)")
    model.load_state_dict(saved)
    return state


def save_resume_state(path, history, writer, loader_rng, **state):  # resume step 1
    """Everything the next step depends on. Every rank calls it (each rank's random generators are
    gathered); rank 0 alone writes, atomically."""
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state(loader_rng))
    if dist.get_rank() == 0:
        # A GradScaler's state_dict() belongs here too when mixed precision uses one (notebook 05).
        save_atomically({**state, "rng": rngs, "loss_history": history, "world_size": dist.get_world_size()}, path)
        writer.flush()  # resume step 4: the curve up to this step is on disk before a crash can lose it


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
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # resume step 5: 0, then 1 after a restart
    # DDP step 2: bind the process to its own device *before* anything touches it (cpu without accelerators).
    device, backend = pick_device_and_backend(local_rank, local_world_size)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    torch.manual_seed(args.seed)  # the same initial weights on every run

    # Whatever can be wrong with the input is found before training starts: one "error: ..." line, exit 2.
    try:  # DDP step 5: checked on every rank before the process group exists, so every rank stops
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
        check_writable(args.checkpoint)  # not after an epoch of training
        # resume step 2: every rank loads the checkpoint onto its own device; a bad one stops all before training.
        model_name = args.model or DEFAULT_MODEL[args.dataset]
        model = build_model(model_name, num_classes).to(device)
        resumed = load_resume_state(args.checkpoint, model, device) if args.resume and args.checkpoint.exists() else None
    except (DatasetError, CourseError) as error:  # resume step 2: a bad checkpoint is bad input too
        fail(error)
    # resume step 4: continue the curve: TensorBoard drops the events a failed attempt logged after the checkpoint.
    purge = resumed["step"] + 1 if resumed else None
    writer = SummaryWriter(args.run_dir, purge_step=purge) if rank == 0 else None  # DDP step 5: one writer
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))  # resume step 5: see notebook 06
    if rank == 0 and restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("warning: a restarted gloo group may read the dead workers' addresses from torchrun's shared store; "
              "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", flush=True)
    if torchrun:  # DDP step 1: join the others (nccl for GPUs, gloo for CPUs)
        dist.init_process_group(backend)
    else:  # DDP step 1: `python train_ddp.py`: a group of this one process (no torchrun to meet the others at)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # DDP step 4: each rank reads its own 1/world_size of the data (same seeded permutation, every
    # world_size-th index); validation is split without padding so that no image is counted twice.
    sampler = ResumableSampler(train_set, seed=args.seed)  # resume step 3
    val_set = Subset(val_set, range(rank, len(val_set), world_size))
    # resume step 3: the loader draws its workers' seed each epoch; from its own generator, which is saved,
    # not from the global one (which random augmentation uses). Exact resumes mid-epoch need --workers 0.
    loader_rng = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=device.type == "cuda", persistent_workers=args.workers > 0,
                              generator=loader_rng)
    val_loader = DataLoader(val_set, 256, num_workers=args.workers)

    # resume step 2: the model was built above, before the process group, to check the checkpoint against it.
    # DDP step 3: wrap. DDP copies rank 0's weights to every rank now, and averages the gradients in backward().
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # resume step 1: a learning-rate schedule, stepped every step: more state that must survive a restart.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.max_steps or args.epochs * len(train_loader))
    criterion = nn.CrossEntropyLoss().to(device)  # moves nothing here; a weighted loss holds a tensor to move

    if rank == 0:  # DDP step 5
        print(f"{NAME}: {len(train_set)} training samples, {world_size} ranks, batch {args.batch_size} per rank "
              f"= global batch {args.batch_size * world_size}", flush=True)
    print(f"rank {rank} (local rank {local_rank}) on {device}, attempt {attempt}", flush=True)  # resume step 5

    # Steady-state speed: the first steps (allocation, caches) are not timed, nor is evaluation; a GPU runs
    # ahead of Python, so each timed step waits for it.
    timer = StepTimer(args.warmup_steps, torch.accelerator.synchronize if device.type != "cpu" else None)
    running = torch.zeros(2, device=device)  # [sum of losses, steps] since the last logged loss
    step, train_loss, history = 0, float("nan"), []
    first_epoch, correct, total = 0, 0, 0  # resume step 2: or as saved

    def save(epoch, sampler_skip):  # resume step 1: the state after this step, for the step that comes next
        save_resume_state(args.checkpoint, history, writer, loader_rng, model=model.module.state_dict(),
                          optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(), epoch=epoch,
                          sampler_skip=sampler_skip, step=step, running=running.cpu(), train_loss=train_loss,
                          val_counts=(correct, total))

    if resumed:  # resume step 2: everything the next step depends on, as it was after the saved step
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        first_epoch, sampler.skip, step = resumed["epoch"], resumed["sampler_skip"], resumed["step"]
        running, train_loss = resumed["running"].to(device), resumed["train_loss"]
        correct, total = resumed["val_counts"]
        history = [tuple(pair) for pair in resumed["loss_history"]]  # resume step 4
        if len(resumed["rng"]) == world_size:  # resume step 3 (another world size: the seeded generators)
            set_rng_state(resumed["rng"][rank], loader_rng)
        print(f"rank {rank}: resumed from {args.checkpoint.name} onto {device}: epoch {first_epoch}, step {step}, "
              f"skipping {sampler.skip} samples (saved by {resumed['world_size']} ranks)", flush=True)
    for epoch in range(first_epoch, args.epochs):  # resume step 2
        if args.max_steps and step >= args.max_steps:  # resume step 3: resumed after its last step: nothing to do
            break
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
            scheduler.step()  # resume step 1
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
            if step % args.save_every == 0 and i + 1 < steps:  # resume step 1: mid-epoch checkpoint
                save(epoch, sampler.skip + (i + 1) * args.batch_size * world_size)
            if step == args.crash_at_step and rank == 1 and attempt == 0:  # resume step 5: the injected fault
                raise RuntimeError(f"injected crash: rank {rank} at step {step} (--crash-at-step)")

        counts = evaluate(model, val_loader, device)
        dist.all_reduce(counts)  # DDP step 5: exact global accuracy = summed counts of all ranks
        correct, total = counts.tolist()
        if rank == 0:  # DDP step 5: one writer; save the unwrapped model, so keys carry no "module." prefix
            writer.add_scalar("val/accuracy", correct / total, step)
            print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
                  f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        whole = steps == len(train_loader)  # resume step 1: after validation, on every rank; where the next step starts
        save(epoch + 1 if whole else epoch, 0 if whole else sampler.skip + steps * args.batch_size * world_size)
        sampler.skip = 0  # resume step 3: the next epoch starts at its beginning
        if step == args.max_steps:
            break

    metrics = {"script": NAME, "world_size": world_size, "backend": backend, "device": str(device),
               "batch_per_rank": args.batch_size, "global_batch": args.batch_size * world_size, "lr": args.lr,
               "dataset": args.dataset, "model": model_name, "steps": step,
               **timer.summary(world_size),  # DDP step 5: samples/s summed over the ranks
               "final_train_loss": train_loss, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "wall_time_s": round(time.time() - start, 3), "train_loss_history": history,
               "resume_step": resumed["step"] if resumed else None}  # resume step 4
    if rank == 0:  # DDP step 5
        writer.close()
        save_json(metrics, args.run_dir / "metrics.json")  # atomically: a reader never sees half a file
        print(f"done: {timer.line(world_size)}, val accuracy {correct / total:.4f}", flush=True)
    dist.barrier()  # DDP step 1: every rank done before any leaves (gloo needs it: notebook 03)
    dist.destroy_process_group()  # DDP step 1: leave the group cleanly


if __name__ == "__main__":
    main()
