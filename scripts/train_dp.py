# Written by notebooks/02_data_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Train a classifier with nn.DataParallel: train_single.py with the model wrapped. Legacy: prefer DDP.

    python train_dp.py                           # one process drives every visible GPU
    torchrun --nproc-per-node=1 train_dp.py      # the same run: DP is always ONE process
    CUDA_VISIBLE_DEVICES=0,1 python train_dp.py  # choose the GPUs

--batch-size is the whole batch of a step; DataParallel splits it across the GPUs. Without GPUs
DataParallel does nothing (device_ids == []): the run is train_single.py's, with "module." keys.
Copy it with the same files as train_single.py. Relative paths are relative to the working directory.
"""
import argparse
import json
import os
import statistics
import sys
import time
from itertools import islice
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from course.data import DatasetError, build_datasets
from course.errors import record  # torch's @record, fixed: torch writes its error file non-atomically
from course.models import DEFAULT_MODEL, build_model

NAME = Path(__file__).stem


def number(kind, low, strict=True):
    """An argparse type: a ``kind`` (int or float) > ``low`` (>= ``low`` if not ``strict``), else one error line."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {low}")
        return value
    return parse


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["mnist", "flowers"], default="mnist")
    parser.add_argument("--data-dir", help="use a real dataset at this path instead of the generated one")
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet18"], help="default: mlp (mnist), cnn (flowers)")
    parser.add_argument("--image-size", type=number(int, 0), default=64, help="flowers only: resized to this")
    parser.add_argument("--epochs", type=number(int, 0), default=3)
    parser.add_argument("--max-steps", type=number(int, 0, False), default=0, help="stop after this many steps (0: none)")
    parser.add_argument("--batch-size", type=number(int, 0), default=64, help="per step, all GPUs (DP)")
    parser.add_argument("--lr", type=number(float, 0.0), default=0.05)
    parser.add_argument("--workers", type=number(int, 0, False), default=0, help="DataLoader worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=number(int, 0), default=10, help="steps between logged losses")
    parser.add_argument("--warmup-steps", type=number(int, 0, False), default=3, help="first steps left out of samples/s")
    parser.add_argument("--run-dir", type=Path, default=Path("runs", NAME), help="TensorBoard events, metrics.json")
    parser.add_argument("--checkpoint", type=Path, default=Path("weights", f"{NAME}.pt"))
    return parser.parse_args()


def fail(message):
    """Bad input found before training: one "error: ..." line and exit status 2, as argparse does."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_writable(path):
    """Refuse a checkpoint path that cannot be written now, naming the cause, not after an epoch of training."""
    blocker = next((p for p in path.parents if p.is_file()), None)
    if blocker:
        fail(f"cannot write the checkpoint {path}: {blocker} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".{path.name}.probe{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        fail(f"cannot write the checkpoint {path}: {error.strerror}")


def save_atomically(obj, path, save=torch.save):
    """save(obj, file) into a temporary file, then rename it onto ``path``: a crash mid-write leaves the old
    file whole. One temporary name per file, so the next save reuses whatever a killed writer left."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:  # a plain open: the file gets the user's umask, like torch.save(obj, path)
        save(obj, f)
    os.replace(tmp, path)  # atomic on POSIX and Windows


def save_json(obj, f):
    f.write(json.dumps(obj, indent=2).encode())


def pick_device():
    """This machine's accelerator if it has one (CUDA, MPS, XPU, ...), else the CPU."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")


@torch.no_grad()
def evaluate(model, loader, device):
    """[correct, total] over the loader, as a tensor (so that it can be summed across processes)."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for images, labels in loader:
        labels = labels.to(device)  # DP: the images stay where they are; DataParallel scatters them
        counts += torch.stack([(model(images).argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)])
    model.train()
    return counts


@record  # under torchrun, a crash shows this process's traceback instead of "error_file: <N/A>"
def main():
    args = parse_args()
    start = time.time()
    device = pick_device()
    torch.manual_seed(args.seed)  # the same initial weights on every run

    # Whatever can be wrong with the input is found before training starts: one "error: ..." line, exit 2.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # DP: N processes would each train their own model
        if int(os.environ.get("RANK", "0")) == 0:  # DP: rank 0 alone reports
            print(f"error: {NAME} is one process for all GPUs; launch it with --nproc-per-node=1", file=sys.stderr)
        raise SystemExit(2)  # DP
    try:
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
    except DatasetError as error:
        fail(error)
    check_writable(args.checkpoint)  # not after an epoch of training
    writer = SummaryWriter(args.run_dir)  # TensorBoard events
    shuffle = torch.Generator()  # reseeded every epoch: a new order each epoch, the same order each run
    sampler = RandomSampler(train_set, generator=shuffle)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    val_loader = DataLoader(val_set, 256, num_workers=args.workers)

    model_name = args.model or DEFAULT_MODEL[args.dataset]
    model = build_model(model_name, num_classes).to(device)
    # DP: wrap, always. Each forward cuts the batch into one chunk per visible GPU, copies the model
    # from device 0 to the others, runs the copies in threads and gathers their outputs on device 0.
    # Without GPUs device_ids is [] and forward just calls the model: one code path everywhere.
    model = nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()  # has no parameters or buffers: nothing to move to the device

    print(f"{NAME}: {len(train_set)} training samples on {device}, batch {args.batch_size}; DataParallel "
          f"device_ids={model.device_ids}{'' if model.device_ids else ' (no GPU: a pass-through)'}", flush=True)

    # Steady-state speed: the first steps (allocation, caches) are not timed, nor is evaluation.
    sync = torch.accelerator.synchronize if device.type != "cpu" else lambda: None  # a GPU runs ahead of Python
    durations, timed_samples = [], 0
    running = torch.zeros(2, device=device)  # [sum of losses, steps] since the last logged loss
    step, train_loss, history = 0, float("nan"), []
    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)
        # Only the steps this epoch runs, so that --max-steps ends the loop (and closes the bar at 100%).
        steps = min(len(train_loader), args.max_steps - step) if args.max_steps else len(train_loader)
        bar = tqdm(islice(train_loader, steps), f"epoch {epoch}", steps, mininterval=3, ncols=90)
        sync()
        last = time.perf_counter()
        for i, (images, labels) in enumerate(bar):
            labels = labels.to(device, non_blocking=True)  # DP: images stay put; the outputs come to device 0
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones_like(loss.detach())])
            if step % args.log_every == 0 or i + 1 == steps:
                train_loss = (running[0] / running[1]).item()  # the mean of the steps since the last log
                running.zero_()
                writer.add_scalar("train/loss", train_loss, step)
                history.append((step, train_loss))
            sync()
            now = time.perf_counter()
            if step > args.warmup_steps:
                durations.append(now - last)
                timed_samples += len(labels)
            last = now

        correct, total = evaluate(model, val_loader, device).tolist()
        writer.add_scalar("val/accuracy", correct / total, step)
        print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
              f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        # DP: save the model inside the wrapper, so that the keys carry no "module." prefix
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
        save_atomically(state, args.checkpoint)
        if step == args.max_steps:
            break

    rate = timed_samples / sum(durations) if durations else None
    metrics = {"script": NAME, "world_size": 1, "backend": None, "device": str(device),
               "batch_per_rank": args.batch_size, "global_batch": args.batch_size, "lr": args.lr,
               "dataset": args.dataset, "model": model_name, "steps": step, "samples_per_s": rate,
               "timed_steps": len(durations), "warmup_steps": min(args.warmup_steps, step),
               "step_time_median_s": statistics.median(durations) if durations else None,
               "final_train_loss": train_loss, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "wall_time_s": round(time.time() - start, 3), "train_loss_history": history,
               "dp_device_ids": model.device_ids}  # DP: one process, driving these GPUs
    writer.close()
    save_atomically(metrics, args.run_dir / "metrics.json", save_json)  # a reader never sees half a file
    speed = f"{rate:.0f} samples/s ({len(durations)} timed steps)" if rate else "no step timed after the warm-up"
    print(f"done: {speed}, val accuracy {correct / total:.4f}", flush=True)


if __name__ == "__main__":
    main()
