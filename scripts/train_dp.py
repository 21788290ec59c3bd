# Written by notebooks/02_data_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Train a classifier with nn.DataParallel: train_single.py with the model wrapped. Legacy: prefer DDP.

    python scripts/train_dp.py                           # one process drives every visible GPU
    torchrun --nproc-per-node=1 scripts/train_dp.py      # the same run: DP is always ONE process
    CUDA_VISIBLE_DEVICES=0,1 python scripts/train_dp.py  # choose the GPUs

--batch-size is the whole batch of a step; DataParallel splits it across the GPUs. Without GPUs
DataParallel does nothing (device_ids == []): the run is train_single.py's, with "module." keys.
"""
import argparse
import os
from itertools import islice
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from tqdm import tqdm

from course.args import nonnegative_int, positive_float, positive_int, repo_path
from course.checkpoint import check_writable, save_checkpoint
from course.data import build_datasets
from course.errors import CourseError, record, reported_once
from course.hardware import pick_device
from course.measure import StepTimer
from course.models import DEFAULT_MODEL, build_model
from course.runlog import RunLog

NAME = Path(__file__).stem


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["mnist", "flowers"], default="mnist")
    parser.add_argument("--data-dir", help="use a real dataset at this path instead of the generated one")
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet18"], help="default: mlp (mnist), cnn (flowers)")
    parser.add_argument("--image-size", type=positive_int, default=64, help="flowers only: resized to this")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--max-steps", type=nonnegative_int, default=0, help="stop after this many steps (0: none)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per step, all GPUs (DP)")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--workers", type=nonnegative_int, default=0, help="DataLoader worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=positive_int, default=10, help="steps between logged losses")
    parser.add_argument("--warmup-steps", type=nonnegative_int, default=3, help="first steps left out of samples/s")
    parser.add_argument("--run-dir", type=repo_path, default=f"runs/{NAME}", help="TensorBoard events, metrics.json")
    parser.add_argument("--checkpoint", type=repo_path, default=f"weights/{NAME}.pt")
    return parser.parse_args()


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
    device = pick_device()  # DP: the first GPU, "device 0", if there is one; it holds the model
    torch.manual_seed(args.seed)  # the same initial weights on every run

    # Whatever can be wrong with the input is found before training starts: one "error: ..." line, exit 2.
    with reported_once(int(os.environ.get("RANK", "0"))):  # DP: started as N processes, rank 0 alone reports
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # DP: N processes would each train their own model
            raise CourseError(f"{NAME} is one process for all GPUs; launch it with --nproc-per-node=1")
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
        check_writable(args.checkpoint)  # not after an epoch of training
        log = RunLog(args.run_dir, script=NAME, world_size=1, backend=None, device=str(device),
                     batch_per_rank=args.batch_size, global_batch=args.batch_size, lr=args.lr,
                     dataset=args.dataset, model=args.model or DEFAULT_MODEL[args.dataset])
    shuffle = torch.Generator()  # reseeded every epoch: a new order each epoch, the same order each run
    sampler = RandomSampler(train_set, generator=shuffle)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    val_loader = DataLoader(val_set, 256, num_workers=args.workers)

    model = build_model(args.model or DEFAULT_MODEL[args.dataset], num_classes).to(device)
    # DP: wrap, always. Each forward cuts the batch into one chunk per visible GPU, copies the model
    # from device 0 to the others, runs the copies in threads and gathers their outputs on device 0.
    # Without GPUs device_ids is [] and forward just calls the model: one code path everywhere.
    model = nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()  # has no parameters or buffers: nothing to move to the device

    print(f"{NAME}: {len(train_set)} training samples on {device}, batch {args.batch_size}; DataParallel "
          f"device_ids={model.device_ids}{'' if model.device_ids else ' (no GPU: a pass-through)'}", flush=True)

    # Steady-state speed: the first steps (allocation, caches) are not timed, nor is evaluation.
    timer = StepTimer(args.warmup_steps, sync=torch.accelerator.synchronize if device.type != "cpu" else None)
    running = torch.zeros(2, device=device)  # [sum of losses, steps] since the last logged loss
    step, train_loss = 0, float("nan")
    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)
        # Only the steps this epoch runs, so that --max-steps ends the loop (and closes the bar at 100%).
        steps = min(len(train_loader), args.max_steps - step) if args.max_steps else len(train_loader)
        bar = tqdm(islice(train_loader, steps), f"epoch {epoch}", steps, mininterval=3, ncols=90)
        timer.start()
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
                log.scalar("train/loss", train_loss, step)
            timer.tick(len(labels))

        correct, total = evaluate(model, val_loader, device).tolist()
        log.scalar("val/accuracy", correct / total, step)
        print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
              f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        # DP: save the model inside the wrapper, so that the keys carry no "module." prefix
        save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "step": step}, args.checkpoint)
        if step == args.max_steps:
            break

    metrics = log.finish(steps=step, **timer.summary(), final_train_loss=train_loss,
                         val_accuracy=correct / total, val_correct=correct, val_total=total,
                         dp_device_ids=model.device_ids)  # DP: one process, driving these GPUs
    rate, timed = metrics["samples_per_s"], metrics["timed_steps"]
    speed = f"{rate:.0f} samples/s ({timed} timed steps)" if rate is not None else "no step timed after the warm-up"
    print(f"done: {speed}, val accuracy {metrics['val_accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
