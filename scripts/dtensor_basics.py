# Written by notebooks/10_tensor_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""DTensor in a few lines: one logical tensor, a slice of it on each rank, and the placements that say how.

    torchrun --nproc-per-node=2 scripts/dtensor_basics.py

A DeviceMesh names the ranks (here a 1-D mesh of all of them); a placement per mesh dimension says what
each rank holds: Shard(d) a slice along dim d, Replicate() the whole tensor, Partial() a summand.
redistribute() changes placements by running the collective that does it.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from course.args import JobParser


def show(rank, what, t):
    """One line per rank: the global shape, the placement, and what this rank really holds."""
    print(f"rank {rank}: {what:<34} global {tuple(t.shape)} {t.placements[0]!s:<12} "
          f"local {tuple(t.to_local().shape)} {t.to_local().flatten().tolist()[:6]}", flush=True)


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="not used: the script only prints (a launcher may pass one)")
    parser.parse_args()  # any other argument: one error line
    world_size = parser.world_size()  # outside torchrun: one line saying how to launch it
    acc = torch.accelerator.current_accelerator(check_available=True)
    per_rank = acc is not None and torch.accelerator.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device_type = acc.type if per_rank and acc.type != "mps" else "cpu"  # the hardware rule, in short
    if device_type != "cpu":
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("tp",))
    rank = dist.get_rank()

    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)  # the same on every rank
    # a scatter of rank 0's tensor (src_data_rank=0, the default); with src_data_rank=None each rank would keep
    # the rows of its own copy, with no communication
    rows = distribute_tensor(full, mesh, [Shard(0)])
    show(rank, "distribute_tensor(Shard(0))", rows)
    cols = rows.redistribute(mesh, [Shard(1)])  # all-to-all (gloo warns: all-gather + chunk instead)
    show(rank, "redistribute -> Shard(1)", cols)
    whole = cols.redistribute(mesh, [Replicate()])  # all-gather
    show(rank, "redistribute -> Replicate()", whole)

    # A matrix product of a column split by a row split leaves each rank a summand: Partial.
    a = distribute_tensor(full, mesh, [Shard(1)])  # (4, 6), columns split
    b = distribute_tensor(full.T.contiguous(), mesh, [Shard(0)])  # (6, 4), rows split
    product = a @ b
    show(rank, "Shard(1) @ Shard(0) -> Partial", product)
    summed = product.redistribute(mesh, [Replicate()])  # all-reduce
    show(rank, "redistribute -> Replicate()", summed)
    scattered = product.redistribute(mesh, [Shard(0)])  # reduce-scatter
    show(rank, "Partial -> Shard(0)", scattered)
    assert isinstance(product.placements[0], Partial)
    assert torch.allclose(summed.full_tensor(), full @ full.T) and torch.equal(whole.full_tensor(), full)
    if rank == 0:
        print("full_tensor() of every result equals the one-process computation", flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
