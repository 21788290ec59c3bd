# Written by notebooks/07_capstone_flowers.ipynb - edit it there; running the notebook rewrites this file.
"""The capstone: a ResNet learns the five flower classes with DDP, end to end.

    torchrun --standalone --nproc-per-node=2 train_flowers.py                  # the generated flowers
    torchrun ... train_flowers.py --data-dir ~/flower_photos --image-size 224 --workers 4
    torchrun ... train_flowers.py --pretrained weights/resnet18_imagenet.pth --freeze-epochs 1
    torchrun ... train_flowers.py --resume     # continue from <checkpoint-dir>/last.pt
    python train_flowers.py ...                # one process, without torchrun

What notebooks 01-06 taught, in one script: the five DDP steps (03); a global batch that stays the same
when the number of processes changes, by gradient accumulation with no_sync (05); a learning rate scaled
to that batch, with warm-up then cosine decay; mixed precision where the device has it (05); exact
distributed evaluation (03); best and last checkpoints, atomic and resumable (06); SyncBatchNorm where
the backend supports it; TensorBoard scalars, image grids and a confusion matrix (07).

To take it home, copy these four files beside it: course/__init__.py (empty), course/data.py and course/models.py
(your data and model code: replace them), course/train_utils.py. It needs torch, torchvision, tqdm and
tensorboard (and matplotlib for two figures, left out without it). Relative paths are relative to the working
directory; outside the course, --data-dir says where the images are.
"""
import argparse
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from course.data import DatasetError, build_datasets, denormalize
from course.models import RESNETS, resnet
from course.train_utils import (
    CourseError,
    StepTimer,
    check_writable,
    fail,
    load_weights,
    number,
    pick_device_and_backend,
    record,
    save_atomically,
    save_json,
    seed,
)

NAME = Path(__file__).stem
# SyncBatchNorm's forward runs on these device types only (torch/nn/modules/batchnorm.py); on the CPU,
# DDP refuses it at construction: ValueError("SyncBatchNorm layers only work with GPU modules").
SYNC_BN_DEVICES = ("cuda", "xpu", "hpu")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="a flower_photos-style folder (default: $COURSE_FLOWERS_DIR, else "
                                           "the generated set)")
    parser.add_argument("--model", choices=sorted(RESNETS), default="resnet18")
    parser.add_argument("--image-size", type=number(int, 0), default=64, help="pixels per side (224 for real photos)")
    parser.add_argument("--epochs", type=number(int, 0), default=8)
    parser.add_argument("--global-batch", type=number(int, 0), default=64,
                        help="samples per optimizer step, over all processes: the same whatever nproc is")
    parser.add_argument("--batch-size", type=number(int, 0), default=32,
                        help="largest micro-batch per process (what fits in memory); accumulation makes up the rest")
    parser.add_argument("--base-lr", type=number(float, 0.0), default=0.2,
                        help="learning rate for a global batch of 256; scaled linearly to --global-batch")
    parser.add_argument("--warmup-epochs", type=number(int, 0, False), default=1, help="linear warm-up, then cosine decay")
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--amp", choices=["auto", "on", "off"], default="auto",
                        help="mixed precision: auto = on accelerators (bf16, or fp16 + GradScaler), off on CPUs")
    parser.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm where the device supports it")
    parser.add_argument("--pretrained", type=Path, help="a .pth state_dict to start from (head replaced)")
    parser.add_argument("--freeze-epochs", type=number(int, 0, False), default=0,
                        help="with --pretrained: train only the new head for this many epochs")
    parser.add_argument("--workers", type=number(int, 0, False), default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--max-steps", type=number(int, 0, False), default=0, help="stop after this many optimizer steps")
    parser.add_argument("--log-every", type=number(int, 0), default=5, help="optimizer steps between logged losses")
    parser.add_argument("--warmup-steps", type=number(int, 0, False), default=3, help="first steps left out of samples/s")
    parser.add_argument("--show-images", type=number(int, 0, False), default=16, help="images per TensorBoard grid")
    parser.add_argument("--run-dir", type=Path, default=Path("runs", NAME), help="TensorBoard events, metrics.json")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("weights", NAME), help="best.pt and last.pt")
    parser.add_argument("--resume", action="store_true", help="continue from <checkpoint-dir>/last.pt if it exists")
    args = parser.parse_args()
    if args.freeze_epochs and not args.pretrained:
        parser.error("--freeze-epochs needs --pretrained (a random backbone has nothing worth freezing)")
    return args


def accumulation(global_batch: int, batch_size: int, world_size: int) -> tuple[int, int]:
    """(micro-batch per process, micro-steps per optimizer step) with world_size x micro x steps == global_batch."""
    steps = math.ceil(global_batch / (world_size * batch_size))
    micro, rest = divmod(global_batch, world_size * steps)
    if rest:
        fail(f"--global-batch {global_batch} cannot be split evenly over {world_size} processes x "
                          f"{steps} micro-steps; choose a multiple of {world_size * steps}")
    return micro, steps


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def amp_dtype(device: torch.device, mode: str):
    """The autocast type, or None: bf16 where the device has it, else fp16 (which needs a GradScaler)."""
    if mode == "off" or (mode == "auto" and device.type == "cpu"):  # most CPUs run bf16 slower than fp32
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16  # a GPU without bf16 units (V100, T4) would only emulate it, slowly
    return torch.bfloat16


@torch.no_grad()
def evaluate(model, loader, device, num_classes, dtype, keep=0):
    """Confusion matrix [true, predicted] and summed loss over this rank's share; up to ``keep`` misclassified."""
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    wrong = []
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(images).float()
        loss_sum += nn.functional.cross_entropy(logits, labels, reduction="sum")
        predicted = logits.argmax(1)
        confusion += torch.bincount(labels * num_classes + predicted, minlength=num_classes ** 2).view_as(confusion)
        miss = (predicted != labels).nonzero().flatten()[: keep - len(wrong)]
        wrong += [(images[i].cpu(), labels[i].item(), predicted[i].item()) for i in miss]
    model.train()
    return confusion, loss_sum, wrong


def pyplot():
    """matplotlib's pyplot without a display (a training process has none), or None if it is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def confusion_figure(matrix, classes, plt):
    """A matplotlib figure of a confusion matrix (rows: true class, columns: predicted), counts in cells."""
    fig, ax = plt.subplots(figsize=(4.6, 4))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set(xlabel="predicted", ylabel="true", title="validation confusion matrix")
    for i, row in enumerate(matrix.tolist()):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center", fontsize=8,
                    color="white" if count > matrix.max().item() / 2 else "#222")
    fig.tight_layout()
    return fig


def misclassified_figure(wrong, classes, plt):
    """The misclassified images with their true and predicted class, as a matplotlib figure."""

    cols = min(8, max(1, len(wrong)))
    rows = max(1, math.ceil(len(wrong) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(1.5 * cols, 1.75 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (image, true, predicted) in zip(axes.flat, wrong):
        ax.imshow(denormalize(image[None])[0].permute(1, 2, 0).numpy())
        ax.set_title(f"{classes[true]}\n-> {classes[predicted]}", fontsize=8)
    fig.tight_layout()
    return fig


@record  # under torchrun, a crash shows this process's traceback instead of "error_file: <N/A>"
def main():
    args = parse_args()
    start = time.time()
    torchrun = "RANK" in os.environ  # else plain python: a job of one process
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world_size, local_world_size = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device, backend = pick_device_and_backend(local_rank, local_world_size)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    last_path, best_path = args.checkpoint_dir / "last.pt", args.checkpoint_dir / "best.pt"

    # Everything that can be wrong with the input is found before the process group exists, on every rank:
    # each prints the same one "error: ..." line and exits with status 2 (no rank is left waiting for another).
    micro, accum = accumulation(args.global_batch, args.batch_size, world_size)
    try:  # every image is decoded once here: a corrupt one stops the run now, not in the middle of an epoch
        train_set, val_set, num_classes = build_datasets("flowers", args.data_dir, args.image_size)
        check_writable(last_path)
        check_writable(best_path)
        check_writable(args.run_dir / "metrics.json", "the run directory")  # and TensorBoard's
        model = resnet(args.model, num_classes).to(device)
        if args.pretrained:  # e.g. torchvision's ImageNet weights: everything but the 1000-class head
            load_weights(args.pretrained, model, device, skip=("fc.",))
        resumed = load_weights(last_path, model, device) if args.resume and last_path.exists() else None
    except (DatasetError, CourseError) as error:
        fail(error)
    classes = train_set.base.classes
    if resumed and resumed.get("config", {}).get("classes") != classes:
        fail(f"{last_path} was trained on other classes: {resumed.get('config', {}).get('classes')}")
    if resumed and (resumed["epoch"] >= args.epochs or 0 < args.max_steps <= resumed["step"]):
        fail(f"{last_path} has trained {resumed['epoch']} epochs ({resumed['step']} steps) already; "
             "pass a larger --epochs (or --max-steps) to train on")
    # Rank 0 writes the TensorBoard events. A resumed run hides the events its crashed predecessor logged after
    # the checkpoint (purge_step), so the curve continues without a repeated stretch.
    writer = SummaryWriter(args.run_dir, purge_step=resumed["step"] + 1 if resumed else None) if rank == 0 else None
    loss_history = []  # (step, global mean loss), for metrics.json
    if torchrun:
        dist.init_process_group(backend)
    else:  # `python train_flowers.py`: a group of this one process (no torchrun to meet the others at)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    # Exact global batch: world_size processes x `accum` micro-steps x `micro` samples, whatever world_size is.
    sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, micro, sampler=sampler, num_workers=args.workers, drop_last=True,
                              pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    # Validation split without padding: every image is evaluated once, by one rank.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 2 * micro,
                            num_workers=args.workers)
    steps_per_epoch = len(train_loader) // accum
    total_steps = args.epochs * steps_per_epoch
    # The learning rate grows with the global batch (linear scaling); warm-up keeps the first large steps sane.
    peak_lr = args.base_lr * args.global_batch / 256
    warmup = args.warmup_epochs * steps_per_epoch

    sync_bn = args.sync_bn and device.type in SYNC_BN_DEVICES
    if sync_bn:  # BatchNorm statistics over the global micro-batch instead of each rank's own
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif args.sync_bn and rank == 0:
        print(f"note: --sync-bn ignored on {device.type}: SyncBatchNorm needs GPU modules (DDP raises "
              "ValueError on CPU modules); each rank normalizes with its own batch statistics", flush=True)
    dtype = amp_dtype(device, args.amp)
    # fp16 needs loss scaling (small gradients underflow); bf16 and fp32 do not: the scaler is then a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, nesterov=True,
                                weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss()
    step, first_epoch, best, history = 0, 0, 0.0, []
    if resumed:  # at an epoch boundary: what the next epoch depends on (notebook 06 resumes mid-epoch too)
        optimizer.load_state_dict(resumed["optimizer"])
        scaler.load_state_dict(resumed["scaler"])
        step, first_epoch, best, history = resumed["step"], resumed["epoch"], resumed["best_accuracy"], resumed["history"]
        loss_history = [tuple(pair) for pair in resumed["loss_history"]]

    def wrap(frozen: bool):
        """DDP over the parameters that train now. DDP decides at construction which parameters it all-reduces,
        so after unfreezing the backbone the model is wrapped again."""
        for name, p in model.named_parameters():
            p.requires_grad_(not frozen or name.startswith("fc."))
        return DDP(model, device_ids=[device.index] if device.type != "cpu" else None)

    frozen = first_epoch < args.freeze_epochs
    ddp = wrap(frozen)
    if rank == 0:
        print(f"{NAME}: {args.model}, {len(train_set)} training images of {len(classes)} classes at "
              f"{args.image_size} px; {world_size} process(es) x {accum} micro-step(s) x {micro} = global batch "
              f"{args.global_batch}; peak lr {peak_lr:.3g}; amp {dtype or 'off'}; sync-bn {sync_bn}; "
              f"{steps_per_epoch} steps per epoch", flush=True)
        if resumed:
            print(f"resumed from {last_path.name}: epoch {first_epoch}, step {step}", flush=True)
        if frozen:
            print(f"backbone frozen for epoch(s) {first_epoch}-{args.freeze_epochs - 1}: only the new head trains",
                  flush=True)

    # Steady-state speed: the first --warmup-steps steps of this run (allocation, caches) are not timed, nor is
    # evaluation; a GPU runs ahead of Python, so each timed step waits for it.
    timer = StepTimer(args.warmup_steps, torch.accelerator.synchronize if device.type != "cpu" else None)
    running = torch.zeros(2, device=device)  # [sum of losses, steps] since the last logged loss
    elapsed = history[-1]["elapsed_s"] if history else 0.0  # training + evaluation time, for time-to-accuracy
    shown = False
    for epoch in range(first_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        if frozen and epoch >= args.freeze_epochs:
            frozen, ddp = False, wrap(False)
            if rank == 0:
                print(f"epoch {epoch}: backbone unfrozen; DDP wrapped again, now over every parameter", flush=True)
        sampler.set_epoch(epoch)
        steps = min(steps_per_epoch, args.max_steps - step) if args.max_steps else steps_per_epoch
        batches = iter(train_loader)
        epoch_start, epoch_loss = time.perf_counter(), torch.zeros(2, device=device)
        samples_before, seconds_before = timer.samples, sum(timer.durations)
        timer.start()
        for _ in tqdm(range(steps), f"epoch {epoch}", mininterval=3, ncols=90, disable=rank != 0):
            lr = lr_at(step, peak_lr, warmup, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for k in range(accum):
                images, labels = next(batches)
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                if not shown and writer and args.show_images:  # what the model sees: augmented images
                    writer.add_images("train/augmented", denormalize(images[: args.show_images]), step)
                    shown = True
                # no_sync: the non-final micro-steps only add into .grad; the last one all-reduces the sum
                with ddp.no_sync() if k < accum - 1 else nullcontext():
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                        loss = criterion(ddp(images), labels) / accum  # the mean over the whole global batch
                    scaler.scale(loss).backward()
                running[0] += loss.detach().float()
                epoch_loss[0] += loss.detach().float()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            running[1] += 1
            epoch_loss[1] += 1
            if writer:
                writer.add_scalar("train/lr", lr, step)  # the rate this step used (not the next one's)
            if step % args.log_every == 0:
                dist.all_reduce(running)  # the global mean loss, not rank 0's
                loss_history.append((step, (running[0] / running[1]).item()))
                if writer:
                    writer.add_scalar("train/loss", loss_history[-1][1], step)
                running.zero_()
            timer.tick(accum * micro)

        final = epoch == args.epochs - 1 or (args.max_steps and step >= args.max_steps)
        keep = args.show_images if final and writer else 0
        confusion, val_loss, wrong = evaluate(ddp.module, val_loader, device, num_classes, dtype, keep)
        dist.all_reduce(confusion)  # exact global counts: each rank evaluated its own images
        dist.all_reduce(val_loss)
        dist.all_reduce(epoch_loss)
        elapsed += time.perf_counter() - epoch_start
        correct, total = confusion.trace().item(), confusion.sum().item()
        accuracy = correct / total
        per_class = (confusion.diag() / confusion.sum(1).clamp(min=1)).tolist()
        rate = (timer.samples - samples_before) / max(1e-9, sum(timer.durations) - seconds_before) * world_size
        history.append({"epoch": epoch, "step": step, "lr_last": lr, "train_loss": (epoch_loss[0] / epoch_loss[1]).item(),
                        "val_loss": val_loss.item() / total, "val_accuracy": accuracy, "elapsed_s": round(elapsed, 2),
                        "samples_per_s": rate if timer.samples > samples_before else None})
        if writer:
            writer.add_scalar("val/accuracy", accuracy, step)
            writer.add_scalar("val/loss", val_loss.item() / total, step)
            for name, value in zip(classes, per_class):
                writer.add_scalar(f"val_class/{name}", value, step)
        plt = pyplot() if writer and final else None
        if plt:
            writer.add_figure("val/confusion_matrix", confusion_figure(confusion.cpu(), classes, plt), step)
            if wrong:
                writer.add_figure("val/misclassified_rank0", misclassified_figure(wrong, classes, plt), step)
        if rank == 0:  # one writer; checkpoints hold the unwrapped model (no "module." prefix), atomically saved
            print(f"epoch {epoch}: step {step}, lr {lr:.3g}, train loss {history[-1]['train_loss']:.3f}, "
                  f"val accuracy {accuracy:.3f} ({correct}/{total}), {elapsed:.0f} s", flush=True)
            config = {"model": args.model, "image_size": args.image_size, "classes": classes}
            if accuracy > best:
                best = accuracy
                save_atomically({"model": model.state_dict(), "config": config, "epoch": epoch,
                                 "val_accuracy": accuracy}, best_path)
            save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "config": config, "epoch": epoch + 1, "step": step,
                             "best_accuracy": best, "history": history, "loss_history": loss_history}, last_path)
            writer.flush()  # the events so far are on disk with the checkpoint: a crash loses none of them
        best = max(best, accuracy)  # every rank: the same value rank 0 saved

    metrics = {"script": NAME, "world_size": world_size, "backend": backend, "device": str(device),
               "model": args.model, "image_size": args.image_size, "classes": classes,
               **timer.summary(world_size),  # samples/s summed over the ranks
               "steps": step, "epochs_done": len(history), "global_batch": args.global_batch, "micro_batch": micro,
               "accumulation_steps": accum, "peak_lr": peak_lr, "amp": str(dtype or "off"), "sync_bn": sync_bn,
               "pretrained": str(args.pretrained or ""), "freeze_epochs": args.freeze_epochs,
               "val_accuracy": history[-1]["val_accuracy"], "best_accuracy": best,
               "per_class_accuracy": dict(zip(classes, per_class)), "confusion": confusion.tolist(),
               "history": history, "checkpoint": str(best_path), "wall_time_s": round(time.time() - start, 3),
               "train_loss_history": loss_history}
    if rank == 0:
        writer.close()
        save_json(metrics, args.run_dir / "metrics.json")  # atomically: a reader never sees half a file
        print(f"done: {timer.line(world_size)}, val accuracy {metrics['val_accuracy']:.3f}, best {best:.3f} -> "
              f"{best_path}", flush=True)
    dist.barrier()  # every rank done before any leaves (gloo needs it: notebook 03)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
