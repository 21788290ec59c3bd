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
import time
from itertools import islice
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
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
    one_process_only,
    pick_device,
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
    parser.add_argument("--batch-size", type=number(int, 0), default=64, help="per step, all GPUs (DP)")
    parser.add_argument("--lr", type=number(float, 0.0), default=0.05)
    parser.add_argument("--workers", type=number(int, 0, False), default=0, help="DataLoader worker processes")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--log-every", type=number(int, 0), default=10, help="steps between logged losses")
    parser.add_argument("--warmup-steps", type=number(int, 0, False), default=3, help="first steps left out of samples/s")
    parser.add_argument("--run-dir", type=Path, default=Path("runs", NAME), help="TensorBoard events, metrics.json")
    parser.add_argument("--checkpoint", type=Path, default=Path("weights", f"{NAME}.pt"))
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
    start = time.time()
    one_process_only(NAME, "is one process for all GPUs")  # DP: N processes would each train their own model
    device = pick_device()  # this machine's accelerator, else the CPU
    torch.manual_seed(args.seed)  # the same initial weights on every run

    # Whatever can be wrong with the input is found before training starts: one "error: ..." line, exit 2.
    try:
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
        check_writable(args.checkpoint)  # not after an epoch of training
    except (DatasetError, CourseError) as error:
        fail(error)
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
    criterion = nn.CrossEntropyLoss().to(device)  # moves nothing here; a weighted loss holds a tensor to move

    print(f"{NAME}: {len(train_set)} training samples on {device}, batch {args.batch_size}; DataParallel "
          f"device_ids={model.device_ids}{'' if model.device_ids else ' (no GPU: a pass-through)'}", flush=True)

    # Steady-state speed: the first steps (allocation, caches) are not timed, nor is evaluation; a GPU runs
    # ahead of Python, so each timed step waits for it.
    timer = StepTimer(args.warmup_steps, torch.accelerator.synchronize if device.type != "cpu" else None)
    running = torch.zeros(2, device=device)  # [sum of losses, steps] since the last logged loss
    step, train_loss, history = 0, float("nan"), []
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
                writer.add_scalar("train/loss", train_loss, step)
                history.append((step, train_loss))
            timer.tick(len(labels))

        correct, total = evaluate(model, val_loader, device).tolist()
        writer.add_scalar("val/accuracy", correct / total, step)
        print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
              f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        # DP: save the model inside the wrapper, so that the keys carry no "module." prefix
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
        save_atomically(state, args.checkpoint)
        if step == args.max_steps:
            break

    metrics = {"script": NAME, "world_size": 1, "backend": None, "device": str(device),
               "batch_per_rank": args.batch_size, "global_batch": args.batch_size, "lr": args.lr,
               "dataset": args.dataset, "model": model_name, "steps": step, **timer.summary(),
               "final_train_loss": train_loss, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "wall_time_s": round(time.time() - start, 3), "train_loss_history": history,
               "dp_device_ids": model.device_ids}  # DP: one process, driving these GPUs
    writer.close()
    save_json(metrics, args.run_dir / "metrics.json")  # atomically: a reader never sees half a file
    print(f"done: {timer.line()}, val accuracy {correct / total:.4f}", flush=True)


if __name__ == "__main__":
    main()
