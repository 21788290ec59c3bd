# Written by notebooks/11_pipeline_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Every pipeline schedule of torch.distributed.pipelining on the same stages, timed per rank.

    torchrun --nproc-per-node=2 scripts/pp_schedules.py --rounds 5 --microbatches 1 2 4 8

Configurations: GPipe and 1F1B for each --microbatches value (the sweep), and interleaved 1F1B and
interleaved zero-bubble (2 stages per rank) at the largest. Each one's first step is checked against one
process (gradients) and not timed; then --rounds rounds, the configurations interleaved (the order
reversed every other round), one recorded step each: every forward, backward and send/recv wait of every
rank (course.pp_recorder.StageRecorder), and the activation bytes each rank held at most. Rank 0 writes it all.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from course import flag
from course.args import JobParser, check_gpt_size, output_dir, positive_int
from course.errors import reported_once
from course.gpt import GPT, GPTConfig, loss_fn
from course.gpt_stages import GPTStage
from course.lm_data import DataError, load_lm_data
from course.pp_recorder import StageRecorder
from course.rundir import claim_run_dir

SCHEDULES = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
             "interleaved1f1b": pipelining.ScheduleInterleaved1F1B,
             "zerobubble": pipelining.ScheduleInterleavedZeroBubble}


def parse_args():
    """The flags and the data, checked before the process group starts: bad input gets one error line."""
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--n-layer", type=positive_int, default=4)
    parser.add_argument("--n-embd", type=positive_int, default=128)
    parser.add_argument("--run-dir", type=output_dir, default="runs/pp_schedules")
    args = parser.parse_args()
    world_size, top, heads = parser.world_size(), max(args.microbatches), GPTConfig.n_head
    if args.n_embd % heads:
        parser.error(f"argument --n-embd: {args.n_embd} does not split into the model's {heads} heads of equal width")
    if args.n_layer < 2 * world_size:
        parser.error(f"argument --n-layer: {args.n_layer} blocks cannot be cut into the {2 * world_size} stages of "
                     f"the interleaved schedules (2 per process on {world_size} processes)")
    uneven = [m for m in args.microbatches if args.batch_size % m]
    if uneven:
        parser.error(f"argument --microbatches: {uneven[0]} does not divide --batch-size {args.batch_size} "
                     "(a stage infers its shapes from the first micro-batch, so all must be equal)")
    if top % max(1, top // world_size):  # torch's rule for the interleaved schedules, run at the largest m
        parser.error(f"argument --microbatches: the interleaved schedules run {top} micro-batches in "
                     f"max(1, {top} // {world_size}) = {top // world_size} equal rounds, which does not divide {top}")
    try:
        data = load_lm_data(batch_size=args.batch_size)
    except DataError as error:
        parser.error(f"argument {error.flag}: {error}")
    check_gpt_size(parser, args, data)  # before any allocation: "needs about X GB, this machine has Y GB"
    return args, data


def pick_device(local_rank):
    """accelerator:local_rank when there is one for every process on this machine, else the CPU (gloo)."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is not None and torch.accelerator.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        backend = dist.get_default_backend_for_device(acc.type)
        if acc.type in dist.Backend.backend_capability.get(backend, ()):
            return torch.device(acc.type, local_rank)
    return torch.device("cpu")


def build(name, m, cfg, rank, world_size, device):
    """Fresh stages (same seed: the same weights) and the schedule ``name`` over them."""
    per_rank = 1 if name in ("gpipe", "1f1b") else 2
    n = per_rank * world_size
    torch.manual_seed(0)
    model = GPT(cfg)
    stages = [pipelining.PipelineStage(GPTStage(model, i, n).to(device), i, n, device)
              for i in range(rank, n, world_size)]
    schedule = SCHEDULES[name](stages[0] if per_rank == 1 else stages, m, loss_fn=loss_fn)
    return stages, schedule


def run_step(stages, schedule, x, y, rank, world_size):
    for s in stages:
        s.submod.zero_grad(set_to_none=True)
    losses = []
    schedule.step(*((x,) if rank == 0 else ()), target=y if rank == world_size - 1 else None, losses=losses)
    return losses


def main():
    args, data = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    rank = int(os.environ["RANK"])  # rank 0 writes --run-dir, so it claims it (staged: the launcher does)
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    dist.init_process_group(dist.get_default_backend_for_device(device.type))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size, n_layer=args.n_layer, n_embd=args.n_embd)
    x, y = (t.to(device) for t in data.batch("train", 0, args.batch_size))
    torch.manual_seed(0)
    reference = GPT(cfg).to(device)  # one process, for the gradient check
    loss_fn(reference(x), y).backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}

    top = max(args.microbatches)
    # 1F1B needs at least one micro-batch per stage (torch raises otherwise): its sweep starts at m = p
    configs = [(name, m) for name in ("gpipe", "1f1b") for m in args.microbatches
               if name == "gpipe" or m >= world_size]
    configs += [("interleaved1f1b", top), ("zerobubble", top)]
    runs = {}
    for name, m in configs:
        stages, schedule = build(name, m, cfg, rank, world_size, device)
        run_step(stages, schedule, x, y, rank, world_size)  # first step: shapes, buffers; checked, not timed
        diff = max((p.grad - ref_grads[n]).abs().max().item() for s in stages for n, p in s.submod.named_parameters())
        runs[f"{name} m={m}"] = {"schedule": name, "m": m, "stages": len(stages) * world_size, "grad_diff": diff,
                                 "stages_here": [s.stage_index for s in stages],
                                 "recorder": StageRecorder(stages, device), "run": (stages, schedule)}
    keys = list(runs)
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            rec, (stages, schedule) = runs[key]["recorder"], runs[key]["run"]
            dist.barrier()
            with rec.step():
                run_step(stages, schedule, x, y, rank, world_size)
            runs[key].setdefault("peak_activation_bytes", []).append(rec.peak_activation_bytes)
            runs[key].setdefault("peak_in_flight", []).append(rec.peak_in_flight)

    mine = {key: {k: v for k, v in run.items() if k not in ("recorder", "run")} |
            {"events": run["recorder"].events, "windows": run["recorder"].windows} for key, run in runs.items()}
    every = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, every, dst=0)
    if rank == 0:
        out = {"script": "pp_schedules", "world_size": world_size, "device": str(device), "rounds": args.rounds,
               "batch_size": args.batch_size, "config": cfg.to_dict(), "microbatches": args.microbatches,
               "runs": {key: {"ranks": every_rank} for key, every_rank in
                        ((k, {r: every[r][k] for r in range(world_size)}) for k in keys)}}
        for key in keys:
            diffs = [every[r][key]["grad_diff"] for r in range(world_size)]
            print(f"{key:22s} {runs[key]['stages']} stages: gradients vs one process, largest difference "
                  f"{max(diffs):.1e}", flush=True)
        path = Path(args.run_dir) / "metrics.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out))
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
