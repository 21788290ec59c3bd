# Written by notebooks/02_data_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Train a digit classifier with nn.DataParallel: train_single.py with the model wrapped. Legacy: prefer DDP.

    python train_dp.py                           # one process drives every visible GPU
    CUDA_VISIBLE_DEVICES=0,1 python train_dp.py  # choose the GPUs
    python train_dp.py --model cnn               # more computation per image

--batch-size is the whole batch of a step; DataParallel splits it across the GPUs. Without a CUDA GPU
DataParallel does nothing (device_ids == []): the run is train_single.py's. Every change from train_single.py
is marked DP (notebook 02). Plain PyTorch: it needs torch, torchvision and tensorboard, nothing else.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


def whole(low):  # an argparse type: a whole number >= low, so that bad input gets one "error:" line
    def check(text):
        if not text.isdigit() or not low <= int(text) < 2**63:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in [{low}, 2**63)")
        return int(text)
    return check


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path("data/mnist"), help="holds MNIST/raw/")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--epochs", type=whole(1), default=3)
    parser.add_argument("--max-steps", type=whole(0), default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--batch-size", type=whole(1), default=64, help="per step, all GPUs together (DP)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=whole(0), default=0, help="DataLoader worker processes")
    parser.add_argument("--seed", type=whole(0), default=0)
    parser.add_argument("--log-every", type=whole(1), default=10, help="steps between logged losses")
    parser.add_argument("--warmup-steps", type=whole(0), default=3, help="first steps left out of samples/s")
    parser.add_argument("--run-dir", type=Path, default=Path("runs", Path(__file__).stem), help="TensorBoard, metrics")
    parser.add_argument("--checkpoint", type=Path, default=Path("weights", Path(__file__).stem + ".pt"))
    args = parser.parse_args()
    if not 0 < args.lr < 10:
        parser.error(f"argument --lr: {args.lr} is not in (0, 10)")
    if args.checkpoint.is_dir():
        parser.error(f"argument --checkpoint: {args.checkpoint} is a folder; give the file to write")
    for flag, folder in (("--run-dir", args.run_dir), ("--checkpoint", args.checkpoint.parent)):
        try:  # now, not after an epoch of training
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"argument {flag}: cannot create the folder {folder}: {error.strerror}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("train_dp.py is one process for all GPUs (DP); for several processes, use train_ddp.py")
    device = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial weights on every run

    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        train_set = datasets.MNIST(args.data_dir, train=True, transform=normalize)
        val_set = datasets.MNIST(args.data_dir, train=False, transform=normalize)
    except RuntimeError as error:  # "Dataset not found. You can use download=True to download it"
        parser.error(f"argument --data-dir: {args.data_dir}: {error}")
    order = torch.Generator()  # reseeded every epoch: a new order each epoch, the same order each run
    sampler = RandomSampler(train_set, generator=order)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers)
    val_loader = DataLoader(val_set, 250)

    if args.model == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    else:
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    model = model.to(device)
    # DP: wrap, always. Each forward cuts the batch into one chunk per visible GPU, copies the model from
    # device 0 to the others, runs the copies in threads and gathers their outputs on device 0. Without a
    # CUDA GPU device_ids is [] and forward just calls the model: one code path everywhere.
    model = nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    writer = SummaryWriter(args.run_dir)  # TensorBoard events
    print(f"{len(train_set)} training images on {device}, batch {args.batch_size}; DataParallel device_ids="
          f"{model.device_ids}{'' if model.device_ids else ' (no CUDA GPU: a pass-through)'}", flush=True)  # DP

    step, losses, history, timed_s, timed_n = 0, [], [], 0.0, 0
    for epoch in range(args.epochs):
        order.manual_seed(args.seed + epoch)
        clock = time.perf_counter()
        for i, (images, labels) in enumerate(loader, 1):
            images, labels = images.to(device), labels.to(device)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            losses.append(loss.item())  # .item() waits for the device, so the clock times finished steps
            if step > args.warmup_steps:  # samples/s leaves out the first steps (allocation, caches)
                timed_s, timed_n = timed_s + time.perf_counter() - clock, timed_n + len(labels)
            clock = time.perf_counter()
            if step % args.log_every == 0 or i == len(loader) or step == args.max_steps:
                mean = torch.tensor([sum(losses), len(losses)], device=device)  # since the last log
                train_loss, losses = (mean[0] / mean[1]).item(), []
                writer.add_scalar("train/loss", train_loss, step)
                history.append((step, train_loss))
                print(f"step {step}: train loss {train_loss:.4f}", flush=True)
            if step == args.max_steps:
                break

        model.eval()
        counts = torch.zeros(2, dtype=torch.int64, device=device)  # correct, total
        with torch.no_grad():
            for images, labels in val_loader:
                images, labels = images.to(device), labels.to(device)
                counts += torch.stack([(model(images).argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)])
        model.train()
        correct, total = counts.tolist()
        writer.add_scalar("val/accuracy", correct / total, step)
        print(f"epoch {epoch}: step {step}, val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        temporary = args.checkpoint.with_suffix(".tmp")  # then renamed: a crash never leaves half a file
        # DP: save the model inside the wrapper (model.module), so that its keys carry no "module." prefix
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, temporary)
        temporary.replace(args.checkpoint)
        if step == args.max_steps:
            break

    samples_per_s = timed_n / timed_s if timed_s else float("nan")
    metrics = {"world_size": 1, "device": str(device), "batch_per_rank": args.batch_size,
               "global_batch": args.batch_size, "lr": args.lr, "model": args.model, "steps": step,
               "samples_per_s": samples_per_s, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "train_loss_history": history,
               "dp_device_ids": model.device_ids}  # DP: one process, driving these GPUs
    (args.run_dir / "metrics.json").write_text(json.dumps(metrics))
    writer.close()
    print(f"done: {samples_per_s:.0f} samples/s, val accuracy {correct / total:.4f}", flush=True)


if __name__ == "__main__":
    main()
