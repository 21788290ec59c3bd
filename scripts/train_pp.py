# Written by notebooks/11_pipeline_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Train the course's small GPT with pipeline parallelism: each rank holds some of the blocks (a stage).

    torchrun --nproc-per-node=2 scripts/train_pp.py                           # GPipe, 4 micro-batches
    torchrun --nproc-per-node=2 scripts/train_pp.py --schedule 1f1b --microbatches 8
    torchrun --nproc-per-node=2 scripts/train_pp.py --schedule interleaved1f1b --n-layer 4   # 2 stages per rank

train_lm.py with the changes marked "PP step N". The batch is cut into micro-batches that flow through the
stages; each micro-batch's mean loss is divided by their number, so the gradients, and the run, equal
train_lm.py's with the same seed and steps. The last stage has the loss: it prints, evaluates and saves.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.utils.tensorboard import SummaryWriter

from course import flag
from course.args import (
    JobParser,
    check_gpt_size,
    lm_seed,
    output_dir,
    positive_float,
    positive_int,
    writable_file,
)
from course.errors import reported_once
from course.gpt import GPT, GPTConfig, loss_fn
from course.gpt_stages import GPTStage
from course.lm_data import DataError, load_lm_data
from course.rundir import claim_run_dir

NAME = Path(__file__).stem
SCHEDULES = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,  # PP step 3: one stage per
             "interleaved1f1b": pipelining.ScheduleInterleaved1F1B,  # rank, or two (interleaved)
             "zerobubble": pipelining.ScheduleInterleavedZeroBubble}


def parse_args():
    """The flags and the data they name, checked here: bad input ends the run with one line, before any work."""
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="a folder of *.txt files instead of the generated arithmetic")
    parser.add_argument("--block-size", type=positive_int, default=64, help="text only: characters per sample")
    parser.add_argument("--steps", type=positive_int, default=1500)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="samples per step")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--n-layer", type=positive_int, default=2)
    parser.add_argument("--n-head", type=positive_int, default=4)
    parser.add_argument("--n-embd", type=positive_int, default=64)
    parser.add_argument("--seed", type=lm_seed, default=0)
    parser.add_argument("--schedule", choices=SCHEDULES, default="gpipe")  # PP step 3
    parser.add_argument("--microbatches", type=positive_int, default=4, help="micro-batches per step")  # PP step 3
    parser.add_argument("--log-every", type=positive_int, default=100, help="steps between printed losses")
    parser.add_argument("--run-dir", type=output_dir, default=f"runs/{NAME}",
                        help="TensorBoard events and metrics.json")
    parser.add_argument("--save", type=writable_file, default=f"weights/{NAME}.pt",
                        help="the final weights ('' : not saved)")
    args = parser.parse_args()
    if args.n_embd % args.n_head:
        parser.error(f"argument --n-head: {args.n_head} does not divide --n-embd {args.n_embd} "
                     "(each head gets an equal share of the width)")
    world_size = parser.world_size()  # PP step 2: torchrun's processes, one stage each (two if interleaved)
    stages = world_size * (1 if args.schedule in ("gpipe", "1f1b") else 2)  # PP step 2
    if args.n_layer < stages:  # PP step 2: a block at least in every stage
        parser.error(f"argument --n-layer: {args.n_layer} blocks cannot be cut into {stages} stages "
                     f"(--schedule {args.schedule} on {world_size} processes)")
    if args.batch_size % args.microbatches:  # PP step 3: equal micro-batches (a stage infers shapes once)
        parser.error(f"argument --microbatches: {args.microbatches} does not divide --batch-size {args.batch_size} "
                     "(a stage infers its shapes from the first micro-batch, so all must be equal)")
    if args.schedule == "1f1b" and args.microbatches < stages:  # PP step 3: torch's rule for 1F1B
        parser.error(f"argument --microbatches: 1F1B needs at least one micro-batch per stage ({stages}), "
                     f"not {args.microbatches}")
    rounds = max(1, args.microbatches // world_size)  # PP step 3: the interleaved schedules run rounds of them
    if stages > world_size and args.microbatches % rounds:  # PP step 3: torch's rule for them
        parser.error(f"argument --microbatches: --schedule {args.schedule} runs the micro-batches in "
                     f"max(1, {args.microbatches} // {world_size}) = {rounds} equal rounds; {rounds} does not divide "
                     f"{args.microbatches}")
    try:
        data = load_lm_data(args.data_dir, args.block_size, args.batch_size)
    except DataError as error:
        parser.error(f"argument {error.flag}: {error}")
    check_gpt_size(parser, args, data, shards=world_size)  # PP step 2: a stage per rank; before any allocation
    return args, data


def pick_device(local_rank):  # PP step 1: one accelerator per process, if its backend carries it
    """accelerator:local_rank when there is one for every process on this machine, else the CPU (gloo)."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is not None and torch.accelerator.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        backend = dist.get_default_backend_for_device(acc.type)  # nccl for CUDA, xccl for XPU
        if acc.type in dist.Backend.backend_capability.get(backend, ()):  # not MPS: gloo cannot carry it
            return torch.device(acc.type, local_rank)
    return torch.device("cpu")


def pipeline(model, schedule, microbatches, rank, world_size, device):  # PP step 2: the stages of this rank
    """Rank r holds stage r (GPipe, 1F1B) or stages r and r + world_size (the interleaved schedules)."""
    per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
    n = per_rank * world_size
    stages = [pipelining.PipelineStage(GPTStage(model, i, n).to(device), i, n, device)
              for i in range(rank, n, world_size)]
    if per_rank == 1:
        return stages, SCHEDULES[schedule](stages[0], microbatches, loss_fn=loss_fn)
    return stages, SCHEDULES[schedule](stages, microbatches, loss_fn=loss_fn)  # PP step 3


@torch.no_grad()
def evaluate(model, data, device):
    """(loss, exact-answer accuracy) on the validation split, in one batch."""
    model.eval()
    x, y = (t.to(device) for t in data.split("val"))
    logits = model(x)
    loss = loss_fn(logits, y).item()
    right, total = data.accuracy(logits, y)
    model.train()
    return loss, right / total


def save_json(obj, path):
    """Write to a temporary file, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def gather_state(stages, last):  # PP step 5: the last rank collects every stage's weights
    """The whole model's state dict on rank ``last`` (each stage's keys are the GPT's own names)."""
    mine = {k: v.cpu() for s in stages for k, v in s.submod.state_dict().items()}
    every = [None] * dist.get_world_size() if dist.get_rank() == last else None
    dist.gather_object(mine, every, dst=last)
    return {k: v for part in every for k, v in part.items()} if every else None


def main():
    args, data = parse_args()
    rank, last = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]) - 1  # PP step 5: the last rank writes
    with reported_once():  # PP step 5: so it claims --run-dir (course.rundir): a second live run gets one error line
        claim = None if rank != last or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    local_rank = int(os.environ["LOCAL_RANK"])  # PP step 1: set by torchrun for each process
    device = pick_device(local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    dist.init_process_group(dist.get_default_backend_for_device(device.type))  # PP step 1
    rank, world_size = dist.get_rank(), dist.get_world_size()
    last = world_size - 1  # PP step 5: the rank that holds the head, and so the loss
    torch.manual_seed(args.seed)  # the same initial weights on every run
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg)  # PP step 2: the whole model on every rank (same seed), each keeps its stages
    stages, schedule = pipeline(model, args.schedule, args.microbatches, rank, world_size, device)  # PP step 2
    params = [p for s in stages for p in s.submod.parameters()]  # PP step 2
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    writer = SummaryWriter(args.run_dir) if rank == last else None  # PP step 5: the last rank writes
    if rank == last:  # PP step 5
        print(f"{NAME}: {model.num_params():,} parameters in {len(stages) * world_size} stages on {world_size} "
              f"ranks ({device}, {dist.get_backend()}), {args.schedule}, {args.microbatches} micro-batches, "
              f"{data.name}, batch {args.batch_size}", flush=True)

    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch("train", step, args.batch_size, args.seed))
        optimizer.zero_grad(set_to_none=True)
        micro_losses = []  # PP step 4: the schedule runs forward and backward of every micro-batch
        inputs = (x,) if rank == 0 else ()  # PP step 4: the first stage reads the tokens, the last the targets
        schedule.step(*inputs, target=y if rank == last else None, losses=micro_losses)
        optimizer.step()
        if rank != last:  # PP step 4: only the last stage has the loss
            continue
        losses.append(torch.stack(micro_losses).mean().item())  # PP step 4: equal micro-batches: the batch's mean
        writer.add_scalar("train/loss", losses[-1], step + 1)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    seconds = time.perf_counter() - start

    state = gather_state(stages, last)  # PP step 5
    dist.barrier()  # PP step 5: every rank done before any leaves: gloo's exit race, notebook 03
    if rank != last:  # PP step 5
        dist.destroy_process_group()
        return
    model.load_state_dict(state)  # PP step 5: the whole trained model, on the last rank
    model.to(device)  # PP step 5
    val_loss, val_accuracy = evaluate(model, data, device)
    writer.add_scalar("val/accuracy", val_accuracy, args.steps)
    writer.close()
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.save + ".tmp")  # PP step 5
        os.replace(args.save + ".tmp", args.save)
    save_json({"script": NAME, "world_size": world_size, "device": str(device), "config": cfg.to_dict(),
               "schedule": args.schedule, "microbatches": args.microbatches, "stages": len(stages) * world_size,
               "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
               "params": model.num_params(), "losses": losses, "val_loss": val_loss,
               "val_accuracy": val_accuracy, "train_seconds": seconds}, Path(args.run_dir) / "metrics.json")
    print(f"done: {args.steps} steps in {seconds:.1f} s, val loss {val_loss:.4f}, "
          f"exact answers {val_accuracy:.1%}", flush=True)
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()  # PP step 1


if __name__ == "__main__":
    main()
