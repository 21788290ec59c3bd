# Reference solution of exercise 4 of notebooks/09_build_it_yourself.ipynb: look after you have tried.
"""Exercise 4: overlap the gradient all-reduce with the backward pass, in buckets (what DDP does inside).

    torchrun --standalone --nproc-per-node=2 scripts/ex4_overlap.py

backward() produces the gradients layer by layer, from the last layer to the first. As soon as every
gradient of a bucket is ready, start an asynchronous all_reduce of the whole bucket (one collective for
several tensors) and let backward() go on computing the earlier layers while it runs. Before the optimizer
step, wait for every bucket's all_reduce and write the averaged values back into the .grad tensors.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from course.exercise_tasks import Trace, mlp, regression_data


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="global: split between the ranks")
    parser.add_argument("--bucket-cap", type=int, default=4500, help="elements per bucket, at most")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/09_build_it_yourself/ex4")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a rank waits for the others")
    return parser.parse_args()


def make_buckets(params, cap):
    """Parameters grouped into buckets of at most `cap` elements (a bigger one alone), last layer first:
    the order in which backward() produces their gradients."""
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        if current and size + p.numel() > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return [*buckets, current] if current else buckets


class BucketedAllReduce:
    """Averages gradients over the ranks: one asynchronous all_reduce per bucket, started in backward()."""

    def __init__(self, model, world_size, cap):
        self.world_size = world_size
        self.buckets = make_buckets(model.parameters(), cap)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # how many gradients of each bucket are ready in this step
        self.pending = []  # (handle, flat tensor, bucket index) of every all_reduce started in this step
        # (a) autograd calls the hook once a parameter's .grad is complete for this backward pass
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def on_grad_ready(self, p):
        """Called by autograd, during backward(), as soon as p.grad is complete."""
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            # (b) the whole bucket is ready: one flat tensor, one collective, and return at once (async_op)
            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, i))

    def finish(self):
        """Before optimizer.step(): wait for every started all_reduce, write the averages back into .grad."""
        # (c) wait() returns when the sum has arrived; then divide and copy each slice back
        for handle, flat, i in self.pending:
            handle.wait()
            flat /= self.world_size
            offset = 0
            for q in self.buckets[i]:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self.pending, self.ready = [], [0] * len(self.buckets)


def main():
    args = parse_args()
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    # (d) One device per process: the accelerator's device local_rank when there is one per process here
    # and its backend can carry it (MPS: no), else the CPU; the device's backend (exercise 1's lines).
    accelerator = torch.accelerator.current_accelerator()  # cuda, xpu, mps, ... or None
    backend = dist.get_default_backend_for_device(accelerator) if accelerator else "gloo"
    if accelerator and accelerator.type in dist.Backend.backend_capability.get(backend, ()) \
            and torch.accelerator.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    data = regression_data(args.steps * args.batch_size, seed=args.seed)
    torch.manual_seed(args.seed)
    model = mlp(8, 64, 64, 64, 64, 1).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # as in exercise 2: every rank starts from rank 0's weights
    comm = BucketedAllReduce(model, world_size, args.bucket_cap)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    trace = Trace(args.out, rank, model, buckets=len(comm.buckets))  # for the checker
    for step in range(args.steps):
        x, y = data[step * args.batch_size:(step + 1) * args.batch_size]  # the global batch of this step
        x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)  # this rank's share
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # the hooks start the buckets' all_reduces while backward() runs
        comm.finish()
        optimizer.step()
        trace.step(model, loss)
    trace.save()
    if rank == 0:
        print(f"{args.steps} steps, {len(comm.buckets)} buckets of sizes "
              f"{[sum(p.numel() for p in b) for b in comm.buckets]}, last loss {loss.item():.4f}")
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
