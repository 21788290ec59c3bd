# Written by notebooks/03_ddp_five_steps.ipynb - edit it there; running the notebook rewrites this file.
"""Data parallelism by hand: average every gradient over the ranks yourself, then compare with DDP.

Each rank computes the gradient of its own half of a batch with a plain model, then calls
average_gradients() below: one all_reduce (sum) per parameter, divided by the number of ranks. A DDP
model that started from the same weights does the same in its backward(); the two gradients must agree.
Then both take a few SGD steps, to show that the copies stay identical.

    torchrun --standalone --nproc-per-node=2 scripts/ddp_by_hand.py
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.args import positive_int, repo_path
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.models import build_model
from course.runlog import RunLog


def average_gradients(model, world_size):
    """What DDP does in backward(), by hand: after backward() has finished, every rank sums each
    gradient over all ranks (all_reduce, in place) and divides by the number of ranks."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)  # sum over ranks: every rank ends with the same tensor
            param.grad /= world_size  # the mean: the gradient of the whole batch's mean loss


def run(name, device, args, rank, world_size):
    """Train two copies of one model for a few steps, one averaged by hand, one by DDP; compare them."""
    train_set, _, num_classes = build_datasets("mnist" if name == "mlp" else "flowers")
    torch.manual_seed(0)  # the same initial weights on every rank, without DDP's broadcast
    by_hand = build_model(name, num_classes).to(device)
    ddp = DDP(copy.deepcopy(by_hand), device_ids=[device.index] if device.type != "cpu" else None)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (by_hand, ddp)]
    grad_diffs, weight_diffs = [], []
    for step in range(args.steps):
        start = (step * world_size + rank) * args.batch_size  # each rank its own samples
        images, labels = map(torch.stack, zip(*[(x, torch.as_tensor(y)) for x, y in
                                                (train_set[i] for i in range(start, start + args.batch_size))]))
        images, labels = images.to(device), labels.to(device)
        for model, optimizer in zip((by_hand, ddp), optimizers):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images), labels).backward()  # DDP averages inside backward()
        average_gradients(by_hand, world_size)  # by hand: after backward()
        grad_diffs.append(max((a.grad - b.grad).abs().max().item()
                              for a, b in zip(by_hand.parameters(), ddp.module.parameters())))
        for optimizer in optimizers:
            optimizer.step()
        weight_diffs.append(max((a - b).abs().max().item()
                                for a, b in zip(by_hand.parameters(), ddp.module.parameters())))
    print(f"rank {rank}, {name}: largest |by hand - DDP| gradient difference {max(grad_diffs):.2e}, "
          f"weights after {args.steps} steps {max(weight_diffs):.2e}", flush=True)
    # DDP's own record of what it did (an internal API, used here only to look): the buckets it built
    # after the first step, and how much of its communication overlapped with backward's computation.
    ddp_log = ddp._get_ddp_logging_data()
    return {"max_abs_grad_diff": max(grad_diffs), "max_abs_weight_diff": max(weight_diffs),
            "parameters": sum(p.numel() for p in by_hand.parameters()),
            "all_reduce_calls_by_hand": sum(p.grad is not None for p in by_hand.parameters()),
            "ddp_bucket_bytes": [int(b) for b in str(ddp_log.get("rebuilt_bucket_sizes", "")).split(", ") if b],
            "ddp_comm_ns": ddp_log.get("avg_backward_comm_time"),
            "ddp_overlap_ns": ddp_log.get("avg_backward_compute_comm_overlap_time")}


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=["mlp", "cnn", "resnet18"], default=["mlp"])
    parser.add_argument("--batch-size", type=positive_int, default=16, help="per rank")
    parser.add_argument("--steps", type=positive_int, default=3, help="SGD steps taken by both copies")
    parser.add_argument("--run-dir", type=repo_path, default="runs/ddp_by_hand")
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    with reported_once(rank):  # a missing dataset or a busy run directory: one line, before the group starts
        for name in args.models:
            build_datasets("mnist" if name == "mlp" else "flowers")
        log = RunLog(args.run_dir, enabled=rank == 0, script="ddp_by_hand", world_size=world_size,
                     batch_per_rank=args.batch_size, steps=args.steps, device=str(device))
    dist.init_process_group(backend_for(device))
    log.finish(models={name: run(name, device, args, rank, world_size) for name in args.models})
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
