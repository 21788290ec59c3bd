# Written by notebooks/03_ddp_five_steps.ipynb - edit it there; running the notebook rewrites this file.
"""Train a digit classifier with DistributedDataParallel: train_single.py plus the five DDP steps.

    torchrun --standalone --nproc-per-node=2 train_ddp.py             # 2 processes (one per GPU, else CPU)
    torchrun --standalone --nproc-per-node=2 train_ddp.py --model cnn # more computation per image
    python train_ddp.py                                               # one process, without torchrun
Plain PyTorch: it needs torch, torchvision and tensorboard, nothing else, and runs copied anywhere.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
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
    parser.add_argument("--batch-size", type=whole(1), default=64)
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
    # DDP step 1: torchrun starts one process per device and tells each who it is (plain python: one process).
    rank = int(os.environ.get("RANK", "0"))  # unique across all machines: decides who writes
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # on this machine: decides which device
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # DDP step 2: one device per process: the accelerator if there is one for each process on this machine
    # and its backend carries its tensors (CUDA: nccl), else the CPU with gloo (a Mac's MPS too).
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    backend = dist.get_default_backend_for_device(accelerator) if accelerator else "gloo"
    per_process = torch.accelerator.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if accelerator and per_process and accelerator.type in dist.Backend.backend_capability[backend]:
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)  # before anything else touches the device
    else:
        device, backend = torch.device("cpu"), "gloo"
    torch.manual_seed(args.seed)  # the same initial weights on every run

    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        train_set = datasets.MNIST(args.data_dir, train=True, transform=normalize)
        val_set = datasets.MNIST(args.data_dir, train=False, transform=normalize)
    except RuntimeError as error:  # "Dataset not found. You can use download=True to download it"
        parser.error(f"argument --data-dir: {args.data_dir}: {error}")
    if "RANK" in os.environ:  # DDP step 1: join the other processes (checked input first, so all stop alike)
        dist.init_process_group(backend)
    else:  # DDP step 1: `python train_ddp.py`: a group of this one process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    sampler = DistributedSampler(train_set, seed=args.seed)  # DDP step 4: every rank its own share
    val_set = Subset(val_set, range(rank, len(val_set), world_size))  # DDP step 4: no padding, no repeats
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers)
    val_loader = DataLoader(val_set, 250)

    if args.model == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    else:
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    model = DDP(model.to(device))  # DDP step 3: copies rank 0's weights to all; backward averages gradients
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    writer = SummaryWriter(args.run_dir) if rank == 0 else None  # DDP step 5: one writer
    print(f"rank {rank} (local rank {local_rank}) on {device}, batch {args.batch_size} of "  # DDP step 5
          f"{args.batch_size * world_size}", flush=True)

    step, losses, history, timed_s, timed_n = 0, [], [], 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP step 4: a new shuffle each epoch, the same on every rank
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
                dist.all_reduce(mean)  # DDP step 5: summed over the ranks: the global mean loss
                train_loss, losses = (mean[0] / mean[1]).item(), []
                history.append((step, train_loss))
                if rank == 0:  # DDP step 5
                    writer.add_scalar("train/loss", train_loss, step)
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
        dist.all_reduce(counts)  # DDP step 5: every rank's counts summed: the exact global accuracy
        correct, total = counts.tolist()
        if rank == 0:  # DDP step 5: one writer; the unwrapped model, so keys have no "module." prefix
            writer.add_scalar("val/accuracy", correct / total, step)
            print(f"epoch {epoch}: step {step}, val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
            temporary = args.checkpoint.with_suffix(".tmp")  # then renamed: a crash never leaves half a file
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, temporary)
            temporary.replace(args.checkpoint)
        if step == args.max_steps:
            break

    samples_per_s = world_size * timed_n / timed_s if timed_s else float("nan")  # DDP step 5: ranks in lockstep
    metrics = {"world_size": world_size, "backend": backend, "device": str(device), "batch_per_rank": args.batch_size,
               "global_batch": args.batch_size * world_size, "lr": args.lr, "model": args.model, "steps": step,
               "samples_per_s": samples_per_s, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "train_loss_history": history}
    if rank == 0:  # DDP step 5
        (args.run_dir / "metrics.json").write_text(json.dumps(metrics))
        writer.close()
        print(f"done: {samples_per_s:.0f} samples/s, val accuracy {correct / total:.4f}", flush=True)
    dist.barrier()  # DDP step 1: every rank done before any leaves (gloo needs it: notebook 03)
    dist.destroy_process_group()  # DDP step 1


if __name__ == "__main__":
    main()
