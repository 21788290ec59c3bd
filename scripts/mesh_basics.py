# Written by notebooks/12_composed_parallelism.ipynb - edit it there; running the notebook rewrites this file.
"""A 2-D device mesh with named dimensions: which ranks talk to which on each dimension, read from the mesh.

    torchrun --nproc-per-node=4 scripts/mesh_basics.py     # ("dp", "tp") = 2 x 2

A mesh is the ranks arranged in a grid; each dimension gets a name and its own process groups. The ranks
in one row share a "tp" group, the ranks in one column a "dp" group. A collective on mesh["tp"] runs
inside the row only; one on mesh["dp"] inside the column only.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from course import flag
from course.args import JobParser, output_dir, positive_int
from course.errors import reported_once
from course.hardware import backend_for, pick_device
from course.rundir import claim_run_dir


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=positive_int, default=2, help="size of the first dimension; 'tp' gets the rest")
    parser.add_argument("--run-dir", type=output_dir, default="runs/mesh_basics")
    args = parser.parse_args()
    if parser.world_size() % args.dp:  # before the process group starts: one error line
        parser.error(f"argument --dp: {args.dp} rows do not divide the {parser.world_size()} processes into a grid")
    device = pick_device(int(os.environ["LOCAL_RANK"]))  # a GPU per rank if the launcher's plan gives one
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    rank = int(os.environ["RANK"])  # rank 0 writes --run-dir, so it claims it (staged: the launcher does)
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    dist.init_process_group(backend_for(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (args.dp, world_size // args.dp), mesh_dim_names=("dp", "tp"))
    me = {"rank": rank, "coordinate": mesh.get_coordinate()}
    for name in ("dp", "tp"):
        sub = mesh[name]  # a 1-D sub-mesh: this rank and the others along that dimension
        me[f"group_{name}"] = sub.get_group().group_name  # the process group's name, as the counter records it
        me[name] = sub.mesh.tolist()  # the global ranks in this rank's group on that dimension
        total = torch.tensor([rank], device=device)
        dist.all_reduce(total, group=sub.get_group())  # runs inside that group only
        me[f"sum_of_ranks_on_{name}"] = total.item()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, me)
    if rank == 0:
        print(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}:\n{mesh.mesh}", flush=True)
        for r in everyone:
            print(f"rank {r['rank']} at {r['coordinate']}: talks to {r['dp']} on 'dp' (all_reduce of ranks = "
                  f"{r['sum_of_ranks_on_dp']}), to {r['tp']} on 'tp' (= {r['sum_of_ranks_on_tp']})", flush=True)
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(args.run_dir) / "metrics.json.tmp"
        tmp.write_text(json.dumps({"script": "mesh_basics", "mesh": mesh.mesh.tolist(),
                                   "names": list(mesh.mesh_dim_names), "ranks": everyone}, indent=2))
        os.replace(tmp, Path(args.run_dir) / "metrics.json")
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
