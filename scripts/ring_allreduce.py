# Written by notebooks/02_data_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""A ring all-reduce, simulated in one process, and a real dist.all_reduce of the same tensors.

    torchrun --standalone --nproc-per-node=2 scripts/ring_allreduce.py --length 10

simulate_ring_all_reduce(tensors) plays N ranks in one process and returns every phase (notebook 02
steps through them). Run under torchrun, each rank builds rank_tensor(rank, length), calls
dist.all_reduce (a sum), and rank 0 writes the result into <run-dir>/metrics.json for the notebook
to compare with the simulation.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from course.args import positive_int, repo_path
from course.errors import record
from course.hardware import backend_for, pick_device

NAME = Path(__file__).stem


def rank_tensor(rank: int, length: int) -> torch.Tensor:
    """Rank r's tensor: (r + 1) * [1, 2, ..., length]. Small integers, so every sum is exact in float32
    whatever order the additions happen in, and the results can be compared with ==."""
    return (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)


def simulate_ring_all_reduce(tensors: list[torch.Tensor]) -> list[dict]:
    """Ring all-reduce (sum) of one tensor per rank, in one process.

    Each rank's tensor is cut into N chunks (torch.tensor_split: sizes differ by at most one). Rank r
    only ever sends to rank (r + 1) % N. Returns the phases, the first being the start; each phase is
    {"name", "sends": [(src, dst, chunk), ...], "chunks": every rank's chunks after the phase}.
    """
    n = len(tensors)
    chunks = [list(t.clone().tensor_split(n)) for t in tensors]

    def phase(name, sends):
        return {"name": name, "sends": sends, "chunks": [[c.clone() for c in rank] for rank in chunks]}

    phases = [phase("start", [])]
    # Reduce-scatter: at step s rank r sends chunk (r - s) % n; the receiver adds it to its own copy.
    # After n - 1 steps, rank r holds the complete sum of chunk (r + 1) % n.
    for s in range(n - 1):
        sends = [(r, (r + 1) % n, (r - s) % n) for r in range(n)]
        payload = [chunks[src][c].clone() for src, _, c in sends]  # all ranks send at once
        for (_, dst, c), data in zip(sends, payload):
            chunks[dst][c] += data
        phases.append(phase(f"reduce-scatter {s + 1}/{n - 1}", sends))
    # All-gather: at step s rank r passes on the complete chunk (r + 1 - s) % n; the receiver keeps it.
    for s in range(n - 1):
        sends = [(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)]
        payload = [chunks[src][c].clone() for src, _, c in sends]
        for (_, dst, c), data in zip(sends, payload):
            chunks[dst][c] = data
        phases.append(phase(f"all-gather {s + 1}/{n - 1}", sends))
    return phases


def elements_sent(phases: list[dict]) -> list[int]:
    """How many tensor elements each rank sent over the whole all-reduce."""
    n = len(phases[0]["chunks"])
    sent = [0] * n
    for p in phases:
        for src, _, c in p["sends"]:
            sent[src] += p["chunks"][src][c].numel()
    return sent


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=positive_int, default=10, help="elements in each rank's tensor")
    parser.add_argument("--run-dir", type=repo_path, default=f"runs/{NAME}", help="where metrics.json goes")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device))

    tensor = rank_tensor(rank, args.length).to(device)
    dist.all_reduce(tensor)  # sum over all ranks, in place: every rank ends with the same values
    print(f"rank {rank}: {tensor.int().tolist()}", flush=True)
    if rank == 0:
        args.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = args.run_dir / f"metrics.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"script": NAME, "world_size": world_size, "backend": backend_for(device),
                                   "device": str(device), "length": args.length, "result": tensor.tolist()}))
        os.replace(tmp, args.run_dir / "metrics.json")  # a reader never sees half a file
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
