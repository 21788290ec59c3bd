"""Train a classifier with nn.DataParallel: train_single.py with the model wrapped. Legacy: prefer DDP.

    python scripts/train_dp.py                           # one process drives every visible GPU
    torchrun --nproc-per-node=1 scripts/train_dp.py      # the same run: DP is always ONE process
    CUDA_VISIBLE_DEVICES=0,1 python scripts/train_dp.py  # choose the GPUs

--batch-size is the whole batch of a step; DataParallel splits it across the GPUs. Without GPUs
DataParallel does nothing (device_ids == []): the run is train_single.py's, with "module." keys.
"""
import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, RandomSampler
from tqdm import tqdm

from course.checkpoint import save_checkpoint
from course.data import DatasetError, build_datasets
from course.hardware import pick_device
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
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step, split across the GPUs (DP)")
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
        labels = labels.to(device)  # DP: the images stay where they are; DataParallel scatters them
        counts += torch.stack([(model(images).argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)])
    model.train()
    return counts


@record  # under torchrun, a crash shows this process's traceback instead of "error_file: <N/A>"
def main():
    args = parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # DP: N processes would each train a model of their own
        raise SystemExit(f"error: {NAME} is one process for all GPUs; launch it with --nproc-per-node=1")
    device = pick_device()  # DP: the first GPU, "device 0", if there is one; it holds the model
    torch.manual_seed(args.seed)  # the same initial weights on every run

    try:
        train_set, val_set, num_classes = build_datasets(args.dataset, args.data_dir, args.image_size)
    except DatasetError as error:
        raise SystemExit(f"error: {error}")
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

    log = RunLog(args.run_dir, script=NAME, world_size=1, backend=None, device=str(device),
                 dp_device_ids=model.device_ids,  # DP: one process, driving these GPUs
                 batch_per_rank=args.batch_size, global_batch=args.batch_size, lr=args.lr,
                 dataset=args.dataset, model=args.model or DEFAULT_MODEL[args.dataset])
    print(f"{NAME}: {len(train_set)} training samples on {device}, batch {args.batch_size}; DataParallel "
          f"device_ids={model.device_ids}{'' if model.device_ids else ' (no GPU: a pass-through)'}", flush=True)

    step, samples, train_seconds, train_loss = 0, 0, 0.0, float("nan")
    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)
        epoch_start = time.perf_counter()
        for images, labels in tqdm(train_loader, desc=f"epoch {epoch}", mininterval=3, ncols=90):
            labels = labels.to(device, non_blocking=True)  # DP: the outputs are gathered on device 0
            loss = criterion(model(images), labels)  # DP: one loss for the whole batch, on device 0
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DP: every copy's gradients are summed onto device 0's parameters
            optimizer.step()  # DP: on device 0 only; the next forward copies the new weights out again
            step += 1
            samples += len(labels)
            if step % args.log_every == 0 or step == args.max_steps:
                train_loss = loss.item()
                log.scalar("train/loss", train_loss, step)
            if step == args.max_steps:
                break
        train_seconds += time.perf_counter() - epoch_start

        correct, total = evaluate(model, val_loader, device).tolist()
        log.scalar("val/accuracy", correct / total, step)
        print(f"epoch {epoch}: step {step}, train loss {train_loss:.4f}, "
              f"val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        # DP: save the model inside the wrapper, so the keys carry no "module." prefix
        save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "step": step}, args.checkpoint)
        if step == args.max_steps:
            break

    metrics = log.finish(steps=step, samples_per_s=samples / train_seconds, final_train_loss=train_loss,
                         val_accuracy=correct / total, val_correct=correct, val_total=total)
    print(f"done: {metrics['samples_per_s']:.0f} samples/s, val accuracy {metrics['val_accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
