# Written by notebooks/04b_pitfalls_reference.ipynb - edit it there; running the notebook rewrites this file.
"""Pitfall 13 (notebook 04b): the learning rate and the global batch, compared after equal samples.

    torchrun --standalone --nproc-per-node=2 scripts/pitfall_lr.py --samples 12800
Trains the MNIST MLP (SGD with momentum 0.9, as train_ddp.py) three ways, each on the same number of samples:
  global batch G at lr L                 (G = 2 ranks x 32: the same steps as 1 rank x 64)
  global batch 2G at lr L (kept)         (2 ranks x 64: half as many steps)
  global batch 2G at lr 2L (scaled)      (linear scaling)
interleaved and repeated with a new seed each round (course.measure.compare); rank 0 prints val accuracy.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.args import positive_float, positive_int, repo_path
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.measure import compare
from course.models import build_model
from course.runlog import RunLog


def train(batch_per_rank: int, lr: float, seed: int, args, train_set, val_part, num_classes, device) -> float:
    """Train from scratch on args.samples samples in all; return the accuracy on the whole validation set."""
    world_size = dist.get_world_size()
    steps = args.samples // (batch_per_rank * world_size)  # equal samples seen: a bigger batch, fewer steps
    torch.manual_seed(seed)
    sampler = DistributedSampler(train_set, seed=seed)
    loader = DataLoader(train_set, batch_per_rank, sampler=sampler)
    model = DDP(build_model("mlp", num_classes).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _, (images, labels) in zip(range(steps), loader):
        loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        counts = sum(torch.stack([(model(x.to(device)).argmax(1) == y.to(device)).sum(),
                                  torch.tensor(len(y), device=device)]) for x, y in DataLoader(val_part, 1000))
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=positive_int, default=12800, help="samples seen by every configuration")
    parser.add_argument("--batch", type=positive_int, default=32, help="per rank, in the smaller global batch")
    parser.add_argument("--lr", type=positive_float, default=0.01, help="learning rate of the smaller batch")
    parser.add_argument("--rounds", type=positive_int, default=2, help="seeds: each configuration this many times")
    parser.add_argument("--run-dir", type=repo_path, default="runs/04_pitfalls/lr")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    with reported_once(rank):
        train_set, val_set, num_classes = build_datasets("mnist")
        log = RunLog(args.run_dir, enabled=rank == 0, samples=args.samples)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=60))
    world_size = dist.get_world_size()
    data = args, train_set, Subset(val_set, range(rank, len(val_set), world_size)), num_classes, device

    small, large = args.batch * world_size, 2 * args.batch * world_size
    configs = {f"global batch {small}, lr {args.lr:g}": (args.batch, args.lr),
               f"global batch {large}, lr {args.lr:g} (kept)": (2 * args.batch, args.lr),
               f"global batch {large}, lr {2 * args.lr:g} (scaled x2)": (2 * args.batch, 2 * args.lr)}
    seeds = {name: iter(range(args.rounds)) for name in configs}  # round k: seed k for every configuration
    result = compare({name: (lambda name=name: train(*configs[name], next(seeds[name]), *data))
                      for name in configs}, repeats=args.rounds, unit="val accuracy")
    if rank == 0:
        result.show()
    log.finish(comparison=result.to_dict(), names=list(configs), world_size=world_size,
               steps={name: args.samples // (b * world_size) for name, (b, _) in configs.items()})
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
