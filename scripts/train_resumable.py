# Written by notebooks/06_multinode_and_faults.ipynb - edit it there; running the notebook rewrites this file.
"""train_ddp.py that survives a crash: full checkpoints, an exact resume, and a crash you can inject.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 train_resumable.py --resume
    torchrun --standalone --nproc-per-node=2 --max-restarts=1 train_resumable.py --resume --crash-at-step 25
                                                         # rank 1 crashes once, after step 25; the restart resumes
With restarts and gloo, start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (notebook 06).
Every change from train_ddp.py is marked "resume step N" (notebook 06). Plain PyTorch, like train_ddp.py: it
needs torch, torchvision and tensorboard, nothing else, and runs copied anywhere.
"""
import argparse
import json
import os
import pickle
import re
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


class ResumableSampler(DistributedSampler):  # resume step 3: skip what was trained on, without loading it
    """DistributedSampler that starts an epoch after its first ``skip`` samples (counted over all ranks)."""

    skip = 0

    def __iter__(self):  # the epoch's order, padded for this world size; this rank takes every world_size-th
        return iter(list(super().__iter__())[self.skip // self.num_replicas:])

    def __len__(self):
        return super().__len__() - self.skip // self.num_replicas


def load_resume_state(path, model, device):  # resume step 2
    """The checkpoint at ``path``, its weights loaded into ``model``, on this rank's own device; ValueError naming
    the file when it is corrupt, would run code, or was made for another model or by another script."""
    try:  # weights_only=True: tensors and plain data, never code; map_location: onto this rank's device
        state = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, KeyError, IndexError) as error:
        code = re.search(r"GLOBAL (\S+)", str(error))  # what the file asked to call
        why = f"would run code ({code[1]}) when loaded, so it was refused" if code else "is corrupt or truncated"
        raise ValueError(f"{path} {why} ({type(error).__name__})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "sampler_skip" not in state:
        raise ValueError(f"{path} is not a {Path(__file__).name} checkpoint (no model/sampler_skip entries)")
    mine, saved = model.state_dict(), state["model"]
    differ = sorted(set(mine) ^ set(saved)) + [k for k in mine if k in saved and mine[k].shape != saved[k].shape]
    if differ:  # another architecture or size: name the first tensor that differs
        k = differ[0]
        raise ValueError(f"{path} was saved from a different model ({len(differ)} tensors differ; {k}: "
                         f"{tuple(saved[k].shape) if k in saved else 'absent'} in the file, "
                         f"{tuple(mine[k].shape) if k in mine else 'absent'} in this model)")
    model.load_state_dict(saved)
    return state


def save_resume_state(path, loader_rng, device, **state):  # resume step 1
    """Every rank calls it: each rank's random generators are gathered (add numpy's and Python's if your code
    draws from them); rank 0 alone writes, to a temporary file then renamed: a crash never leaves half a file."""
    rng = {"torch": torch.get_rng_state(), "loader": loader_rng.get_state()}
    if device.type != "cpu":
        rng["device"] = torch.get_device_module(device).get_rng_state(device)
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng)
    if dist.get_rank() == 0:
        temporary = path.with_suffix(".tmp")
        torch.save({**state, "rng": rngs, "world_size": len(rngs)}, temporary)
        temporary.replace(path)


def set_rng_state(rng, loader_rng, device):  # resume step 3
    torch.set_rng_state(rng["torch"].cpu())  # generator states are CPU tensors; map_location may have moved them
    loader_rng.set_state(rng["loader"].cpu())
    if "device" in rng and device.type != "cpu":
        torch.get_device_module(device).set_rng_state(rng["device"].cpu(), device)


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
    # resume step 1: how often to save, whether to continue from the checkpoint, and a fault to inject (step 5).
    parser.add_argument("--save-every", type=whole(1), default=20, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    parser.add_argument("--crash-at-step", type=whole(0), default=0,
                        help="rank 1 raises after this step, in the first attempt only (0: never)")
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
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # resume step 5: 0, then 1 after a restart
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
    # resume step 2: the model now, before the process group: every rank loads the checkpoint onto its own
    # device and checks that it fits; a bad file stops every rank with one line, before anything is written.
    if args.model == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    else:
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    model, resumed = model.to(device), None
    if args.resume and args.checkpoint.exists():
        try:
            resumed = load_resume_state(args.checkpoint, model, device)
        except ValueError as error:
            parser.error(f"argument --checkpoint: {error}")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))  # resume step 5: see notebook 06
    if rank == 0 and restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("warning: a restarted gloo group may read the dead workers' addresses from torchrun's shared store; "
              "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", flush=True)
    if "RANK" in os.environ:  # DDP step 1: join the other processes (checked input first, so all stop alike)
        dist.init_process_group(backend)
    else:  # DDP step 1: `python train_ddp.py`: a group of this one process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    sampler = ResumableSampler(train_set, seed=args.seed)  # DDP step 4: every rank its own share; resume step 3
    val_set = Subset(val_set, range(rank, len(val_set), world_size))  # DDP step 4: no padding, no repeats
    # resume step 3: the loader draws its workers' seed each epoch from a generator of its own, which is saved,
    # not from the global one (which random augmentation uses). Exact resumes mid-epoch need --workers 0.
    loader_rng = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers, generator=loader_rng)
    val_loader = DataLoader(val_set, 250)

    # resume step 2: the model was built above, before the process group, to check the checkpoint against it.
    model = DDP(model.to(device))  # DDP step 3: copies rank 0's weights to all; backward averages gradients
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # resume step 1: a learning-rate schedule, stepped every step: more state that must survive a restart.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.max_steps or args.epochs * len(loader))
    # resume step 4: continue the curve: TensorBoard drops the events a failed attempt logged after the checkpoint.
    purge = resumed["step"] + 1 if resumed else None
    writer = SummaryWriter(args.run_dir, purge_step=purge) if rank == 0 else None  # DDP step 5: one writer
    print(f"rank {rank} (local rank {local_rank}) on {device}, batch {args.batch_size} of "  # DDP step 5
          f"{args.batch_size * world_size}, attempt {attempt}", flush=True)  # resume step 5

    step, losses, history, timed_s, timed_n = 0, [], [], 0.0, 0
    first_epoch, correct, total = 0, 0, 0  # resume step 2: or as saved

    def save(epoch, sampler_skip):  # resume step 1: the state after this step, for the step that comes next
        save_resume_state(args.checkpoint, loader_rng, device, model=model.module.state_dict(),
                          optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(), epoch=epoch,
                          sampler_skip=sampler_skip, step=step, losses=losses, history=history,
                          val_counts=(correct, total))
        if rank == 0:
            writer.flush()  # resume step 4: the curve up to this step is on disk before a crash can lose it

    if resumed:  # resume step 2: everything the next step depends on, as it was after the saved step
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        first_epoch, sampler.skip, step = resumed["epoch"], resumed["sampler_skip"], resumed["step"]
        losses, history, (correct, total) = resumed["losses"], resumed["history"], resumed["val_counts"]
        if len(resumed["rng"]) == world_size:  # resume step 3 (another world size: the seeded generators)
            set_rng_state(resumed["rng"][rank], loader_rng, device)
        print(f"rank {rank}: resumed from {args.checkpoint.name} onto {device}: epoch {first_epoch}, step {step}, "
              f"skipping {sampler.skip} samples (saved by {resumed['world_size']} ranks)", flush=True)
    for epoch in range(first_epoch, args.epochs):  # resume step 2
        if args.max_steps and step >= args.max_steps:  # resume step 3: resumed after its last step: nothing to do
            break
        sampler.set_epoch(epoch)  # DDP step 4: a new shuffle each epoch, the same on every rank
        clock = time.perf_counter()
        for i, (images, labels) in enumerate(loader, 1):
            images, labels = images.to(device), labels.to(device)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()  # resume step 1
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
            if step % args.save_every == 0 and i < len(loader):  # resume step 1: a mid-epoch checkpoint
                save(epoch, sampler.skip + i * args.batch_size * world_size)
            if step == args.crash_at_step and rank == 1 and attempt == 0:  # resume step 5: the injected fault
                raise RuntimeError(f"injected crash: rank {rank} at step {step} (--crash-at-step)")
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
        if rank == 0:  # DDP step 5: one writer (resume step 1: every rank saves, below)
            writer.add_scalar("val/accuracy", correct / total, step)
            print(f"epoch {epoch}: step {step}, val accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        finished = i == len(loader)  # resume step 1: after validation, on every rank; where the next step starts
        save(epoch + 1 if finished else epoch, 0 if finished else sampler.skip + i * args.batch_size * world_size)
        sampler.skip = 0  # resume step 3: the next epoch starts at its beginning
        if step == args.max_steps:
            break

    samples_per_s = world_size * timed_n / timed_s if timed_s else float("nan")  # DDP step 5: ranks in lockstep
    metrics = {"world_size": world_size, "backend": backend, "device": str(device), "batch_per_rank": args.batch_size,
               "global_batch": args.batch_size * world_size, "lr": args.lr, "model": args.model, "steps": step,
               "samples_per_s": samples_per_s, "val_accuracy": correct / total, "val_correct": correct,
               "val_total": total, "train_loss_history": history,
               "resume_step": resumed["step"] if resumed else None}  # resume step 4
    if rank == 0:  # DDP step 5
        (args.run_dir / "metrics.json").write_text(json.dumps(metrics))
        writer.close()
        print(f"done: {samples_per_s:.0f} samples/s, val accuracy {correct / total:.4f}", flush=True)
    dist.barrier()  # DDP step 1: every rank done before any leaves (gloo needs it: notebook 03)
    dist.destroy_process_group()  # DDP step 1


if __name__ == "__main__":
    main()
