# Written by notebooks/08_sharding_fsdp.ipynb - edit it there; running the notebook rewrites this file.
"""Train a digit classifier with FSDP2 (fully_shard): train_ddp.py with the model sharded across the ranks.

Each rank keeps 1/world_size of every parameter, gradient and optimizer state; whole parameters exist only for
the layer being computed. Every change from train_ddp.py is marked "FSDP step N" (notebook 08).

    torchrun --standalone --nproc-per-node=2 train_fsdp.py              # 2 processes (one per GPU, else CPU)
    torchrun --standalone --nproc-per-node=2 train_fsdp.py --model cnn  # more computation per image
    torchrun --standalone --nproc-per-node=2 train_fsdp.py --no-bf16    # fp32 on GPUs too
The checkpoint is a folder (weights/train_fsdp/): one file per rank; fsdp_checkpoint.py in the course loads it
on any number of ranks and exports one ordinary file. Plain PyTorch, like train_ddp.py: it needs torch,
torchvision and tensorboard, nothing else, and runs copied anywhere.
"""
import argparse
import hashlib
import json
import os
import time
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
    # FSDP step 5: a checkpoint is a folder: one file per rank, and metadata saying where each piece goes.
    parser.add_argument("--checkpoint", type=Path, default=Path("weights", Path(__file__).stem), help="a folder (DCP)")
    # FSDP step 2: free each layer's gathered parameters after its forward (gather them again in backward).
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    # FSDP step 3: bf16 compute with fp32 gradient reduction; default: on where the accelerator has bf16 units.
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, help="default: on for accelerators")
    args = parser.parse_args()
    if not 0 < args.lr < 10:
        parser.error(f"argument --lr: {args.lr} is not in (0, 10)")
    if args.checkpoint.is_file():  # FSDP step 5: the checkpoint is a folder
        parser.error(f"argument --checkpoint: {args.checkpoint} is a file; give the folder to write")
    for flag, folder in (("--run-dir", args.run_dir), ("--checkpoint", args.checkpoint)):  # FSDP step 5
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
    # FSDP step 3: a CPU has no fast bf16, nor has a GPU that only emulates it (V100, T4: including_emulation=False)
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    bf16 = (native_bf16 or device.type not in ("cpu", "cuda")) if args.bf16 is None else args.bf16
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
    mesh = init_device_mesh(device.type, (world_size,))  # FSDP step 1: the ranks that share the shards
    sampler = DistributedSampler(train_set, seed=args.seed)  # DDP step 4: every rank its own share
    # FSDP step 6: every forward all-gathers parameters, so every rank must run as many forwards as the others:
    # each evaluates the same number of images (the last len(val_set) % world_size are left out).
    val_set = Subset(val_set, range(rank, len(val_set) - len(val_set) % world_size, world_size))
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers)
    val_loader = DataLoader(val_set, 250)

    if args.model == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    else:
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    model = model.to(device)  # FSDP step 1: every rank built the same seeded model; fully_shard keeps 1/world_size
    mp = MixedPrecisionPolicy()  # FSDP step 3: fp32 throughout; with bf16 (accelerators), gather and compute
    if bf16:  # FSDP step 3: in bf16, reduce-scatter gradients in fp32; the optimizer updates the fp32 shards
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # FSDP step 1: shard layer by layer, then the root. Each call makes one group: its parameters are gathered
    # in one all-gather just before its forward (and backward), its gradients reduce-scattered in one call, so
    # only one or two layers are ever whole at a time. A bigger model shards its blocks (a ResNet's, a GPT's).
    for layer in model:  # FSDP step 1: the layers that hold weights (Linear, Conv2d; not ReLU, Flatten)
        if list(layer.parameters()):  # FSDP step 2: reshard_after_forward=False keeps them whole
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=args.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # FSDP step 1: the root (kept whole from forward to backward)
    # FSDP step 4: create the optimizer after sharding: fully_shard replaced the parameters with their shards
    # (DTensors), so the optimizer, and its momentum, hold 1/world_size of each.
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
        if rank == 0:  # DDP step 5: one writer (FSDP step 5: but every rank saves its shards, below)
            writer.add_scalar("val/accuracy", correct / total, step)
            print(f"epoch {epoch}: step {step}, val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        # FSDP step 5: every rank writes its own shards, in parallel, and no rank ever holds the whole model.
        # get_state_dict names each tensor as in the plain model ("1.weight"), so the folder loads on any number
        # of ranks and joins into one ordinary file. Epoch and step as tensors: DCP would pickle plain numbers.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "epoch": torch.tensor(epoch),
                  "step": torch.tensor(step)}, checkpoint_id=args.checkpoint)  # FSDP step 5: metadata written last
        dist.barrier()  # FSDP step 5: every rank's pieces on disk, then their checksums (DCP keeps none)
        if rank == 0:  # FSDP step 5: sha256.json, which fsdp_checkpoint.py checks before it loads anything
            pieces = [p for p in sorted(args.checkpoint.iterdir()) if p.name == ".metadata" or p.suffix == ".distcp"]
            digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in pieces}  # one file at a time
            (args.checkpoint / "sha256.tmp").write_text(json.dumps({"sha256": digests}))
            (args.checkpoint / "sha256.tmp").replace(args.checkpoint / "sha256.json")  # FSDP step 5: whole or none
        if step == args.max_steps:
            break

    samples_per_s = world_size * timed_n / timed_s if timed_s else float("nan")  # DDP step 5: ranks in lockstep
    metrics = {"world_size": world_size, "backend": backend, "device": str(device), "batch_per_rank": args.batch_size,
               "global_batch": args.batch_size * world_size, "lr": args.lr, "model": args.model, "steps": step,
               "samples_per_s": samples_per_s, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "train_loss_history": history,
               "reshard_after_forward": args.reshard_after_forward, "bf16": bf16}  # FSDP step 2 and 3: as used
    if rank == 0:  # DDP step 5
        (args.run_dir / "metrics.json").write_text(json.dumps(metrics))
        writer.close()
        print(f"done: {samples_per_s:.0f} samples/s, val accuracy {correct / total:.4f}", flush=True)
    dist.barrier()  # DDP step 1: every rank done before any leaves (gloo needs it: notebook 03)
    dist.destroy_process_group()  # DDP step 1


if __name__ == "__main__":
    main()
