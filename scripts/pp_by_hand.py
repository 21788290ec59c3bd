# Written by notebooks/11_pipeline_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""A 2-stage pipeline by hand: the small GPT cut in two, activations sent forward, gradients sent back.

    torchrun --nproc-per-node=2 scripts/pp_by_hand.py

Part 1: one batch through the pipeline (dist.send / dist.recv), gradients checked against one process.
Part 2: GPipe: the batch cut into micro-batches, all forwards then all backwards, each micro-batch's loss
divided by their number; the gradients checked again, then a few AdamW steps (losses and weights).
Every rank also builds the whole model and computes the one-process reference itself.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from course import flag
from course.args import JobParser, check_gpt_size, output_dir, positive_int
from course.errors import reported_once
from course.gpt import GPT, GPTConfig, loss_fn
from course.gpt_stages import GPTStage
from course.lm_data import DataError, load_lm_data
from course.rundir import claim_run_dir


def parse_args():
    """The flags and the data, checked before the process group starts: bad input gets one error line."""
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--microbatches", type=positive_int, default=4)
    parser.add_argument("--steps", type=positive_int, default=3, help="AdamW steps in part 2")
    parser.add_argument("--n-layer", type=positive_int, default=2)
    parser.add_argument("--run-dir", type=output_dir, default="runs/pp_by_hand")
    args = parser.parse_args()
    if parser.world_size() != 2:
        parser.error(f"torchrun --nproc-per-node: this pipeline's 2 stages need exactly 2 processes, "
                     f"not {parser.world_size()}")
    if args.n_layer < 2:
        parser.error(f"argument --n-layer: {args.n_layer} block cannot be cut into 2 stages")
    if args.batch_size % args.microbatches:
        parser.error(f"argument --microbatches: {args.microbatches} does not divide --batch-size {args.batch_size} "
                     "(every receive buffer has one micro-batch's shape)")
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


def pipeline_step(stage, x, y, microbatches, act_shape, device):
    """GPipe on 2 ranks: every micro-batch forward, then every micro-batch backward. Returns the loss (last stage)."""
    rank = dist.get_rank()
    inputs, outputs = [], []
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):  # all forwards
        if rank == 0:
            out = stage(xm)
            dist.send(out.detach(), dst=1)  # activations forward
        else:
            h = torch.empty(act_shape, device=device)
            dist.recv(h, src=0)
            h.requires_grad_()  # so that backward gives us the gradient to send back
            out = loss_fn(stage(h), ym) / microbatches  # the mean over micro-batches = the batch's mean
            inputs.append(h)
        outputs.append(out)
    loss = 0.0
    for i in reversed(range(microbatches)):  # all backwards, last micro-batch first
        if rank == 0:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=1)  # the gradient of the loss with respect to our output
            outputs[i].backward(grad)
        else:
            outputs[i].backward()
            dist.send(inputs[i].grad, dst=0)  # gradients back
            loss += outputs[i].item()
    return loss


def max_diff(stage, reference) -> float:
    """Largest difference between this stage's gradients and the one-process model's, by name."""
    ref = dict(reference.named_parameters())
    return max((p.grad - ref[name].grad).abs().max().item() for name, p in stage.named_parameters())


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
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size, n_layer=args.n_layer)
    torch.manual_seed(0)
    stage = GPTStage(GPT(cfg), rank, world_size).to(device)  # this rank's half
    torch.manual_seed(0)
    reference = GPT(cfg).to(device)  # the whole model, for the check
    x, y = (t.to(device) for t in data.batch("train", 0, args.batch_size))
    loss_fn(reference(x), y).backward()

    # Part 1: one batch, no micro-batches (one rank is always idle: it waits for the other)
    loss1 = pipeline_step(stage, x, y, 1, (args.batch_size, cfg.block_size, cfg.n_embd), device)
    one_batch = max_diff(stage, reference)
    stage.zero_grad(set_to_none=True)

    # Part 2: GPipe over micro-batches, then a few optimizer steps on both
    m = args.microbatches
    act_shape = (args.batch_size // m, cfg.block_size, cfg.n_embd)
    pipeline_step(stage, x, y, m, act_shape, device)
    gpipe = max_diff(stage, reference)
    opt, ref_opt = (torch.optim.AdamW(mod.parameters(), lr=3e-3) for mod in (stage, reference))
    losses, ref_losses = [], []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch("train", step, args.batch_size))
        opt.zero_grad(set_to_none=True)
        losses.append(pipeline_step(stage, x, y, m, act_shape, device))
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    ref = dict(reference.named_parameters())
    weights = max((p - ref[name]).abs().max().item() for name, p in stage.named_parameters())

    mine = {"rank": rank, "params": [n for n, _ in stage.named_parameters()], "one_batch_grad_diff": one_batch,
            "gpipe_grad_diff": gpipe, "weight_diff": weights, "losses": losses, "ref_losses": ref_losses,
            "first_loss": loss1}
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    if rank == 0:
        for r in every:
            print(f"rank {r['rank']}: {len(r['params'])} tensors ({r['params'][0]} ... {r['params'][-1]}); "
                  f"largest gradient difference from one process: one batch {r['one_batch_grad_diff']:.1e}, "
                  f"GPipe x{m} {r['gpipe_grad_diff']:.1e}; weights after {args.steps} steps {r['weight_diff']:.1e}",
                  flush=True)
        last = every[-1]
        print("losses, pipeline:   " + " ".join(f"{v:.6f}" for v in last["losses"]), flush=True)
        print("losses, 1 process:  " + " ".join(f"{v:.6f}" for v in last["ref_losses"]), flush=True)
        path = Path(args.run_dir) / "metrics.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"script": "pp_by_hand", "world_size": world_size, "device": str(device),
                                    "microbatches": m, "batch_size": args.batch_size, "steps": args.steps,
                                    "ranks": every}, indent=2))
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
