# Written by notebooks/04b_pitfalls_reference.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfalls 9 and 10 (notebook 04b): checkpoints and logs written by every rank, or by rank 0 only.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_rank0.py --bug   # every rank logs and saves
    torchrun --standalone --nproc-per-node=2 scripts/pitfall_rank0.py         # rank 0 only, then a barrier
"""
import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

from course.args import positive_int, repo_path
from course.checkpoint import load_checkpoint, save_checkpoint
from course.errors import record
from course.hardware import backend_for, pick_device
from course.models import mlp


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", action="store_true", help="every rank logs and saves; keys keep 'module.'")
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--run-dir", type=repo_path, default="runs/04_pitfalls/rank0")
    parser.add_argument("--checkpoint", type=repo_path, default="weights/04_pitfalls_rank0.pt")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=60))
    world_size = dist.get_world_size()
    if rank == 0:  # start from an empty run directory, so that only this run's event files are there
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        for old in Path(args.run_dir).glob("events.out.tfevents.*"):
            old.unlink()
    dist.barrier()

    torch.manual_seed(0)
    model = DDP(mlp(num_classes=10, in_features=32, hidden=64).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = SummaryWriter(args.run_dir) if args.bug or rank == 0 else None  # BUG when --bug: one per rank
    generator = torch.Generator().manual_seed(rank)  # each rank its own data, as with a DistributedSampler
    for step in range(1, args.steps + 1):
        x, y = torch.randn(64, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.bug:  # every rank logs the loss of its own share of the batch
            writer.add_scalar("train/loss", loss.item(), step)
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
        else:  # every rank joins the all_reduce; rank 0 alone logs the mean
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                writer.add_scalar("train/loss", mean.item() / world_size, step)
                print(f"step {step}: loss {mean.item() / world_size:.4f} (mean of {world_size} ranks)", flush=True)
    if writer:
        writer.close()

    plain = mlp(num_classes=10, in_features=32, hidden=64).to(device)  # the model as it is used later
    if args.bug:
        torch.save(model.state_dict(), args.checkpoint)  # BUG: every rank writes; keys start with "module."
        print(f"rank {rank}: wrote {args.checkpoint}", flush=True)
        dist.barrier()
        state = torch.load(args.checkpoint)  # BUG: no map_location: tensors return to the device they left
        try:
            plain.load_state_dict(state)
        except RuntimeError as error:
            print(f"rank {rank}: load_state_dict failed: " + " ".join(str(error).split()), flush=True)
    else:
        if rank == 0:
            save_checkpoint({"model": model.module.state_dict()}, args.checkpoint)  # unwrapped: no prefix
            print(f"rank {rank}: wrote {args.checkpoint}", flush=True)
        dist.barrier()  # nobody reads the file before rank 0 has finished writing it
        plain.load_state_dict(load_checkpoint(args.checkpoint, device)["model"])  # onto this rank's device
        same = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.module.state_dict().values()))
        print(f"rank {rank}: loaded onto {device}, weights equal to the trained model: {same}", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
