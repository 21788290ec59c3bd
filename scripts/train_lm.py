# Written by notebooks/10_tensor_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""Train the course's small GPT on one device: written arithmetic (37+45=082), or a folder of text.

    python scripts/train_lm.py                       # 2 blocks, 4 heads, width 64, on generated sums
    python scripts/train_lm.py --data-dir my_texts   # character-level, every *.txt under my_texts/
    torchrun --nproc-per-node=1 scripts/train_lm.py  # the same run, under torchrun

The baseline that train_tp.py is proven equal to: the same seed, data order and steps.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
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
from course.lm_data import DataError, load_lm_data
from course.rundir import claim_run_dir

NAME = Path(__file__).stem


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
    parser.add_argument("--log-every", type=positive_int, default=100, help="steps between printed losses")
    parser.add_argument("--run-dir", type=output_dir, default=f"runs/{NAME}",
                        help="TensorBoard events and metrics.json")
    parser.add_argument("--save", type=writable_file, default=f"weights/{NAME}.pt",
                        help="the final weights ('' : not saved)")
    args = parser.parse_args()
    if args.n_embd % args.n_head:
        parser.error(f"argument --n-head: {args.n_head} does not divide --n-embd {args.n_embd} "
                     "(each head gets an equal share of the width)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would train its own copy into the same files
        parser.error(f"torchrun --nproc-per-node: {NAME}.py is one process (train_tp.py, train_pp.py and train_2d.py "
                     "split the model): run it with python, or --nproc-per-node=1")
    try:
        data = load_lm_data(args.data_dir, args.block_size, args.batch_size)
    except DataError as error:
        parser.error(f"argument {error.flag}: {error}")
    check_gpt_size(parser, args, data)  # before any allocation
    return args, data


def pick_device():
    """The accelerator if there is one (CUDA, MPS, XPU, ...), else the CPU."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(acc.type) if acc is not None else torch.device("cpu")


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


def main():
    args, data = parse_args()
    with reported_once():  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if flag("COURSE_STAGED") else claim_run_dir(args.run_dir)  # staged: the launcher claims it
    device = pick_device()
    torch.manual_seed(args.seed)  # the same initial weights on every run
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    writer = SummaryWriter(args.run_dir)
    print(f"{NAME}: {model.num_params():,} parameters on {device}, {data.name}, "
          f"{len(data.train)} training samples, batch {args.batch_size}", flush=True)

    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch("train", step, args.batch_size, args.seed))
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        writer.add_scalar("train/loss", losses[-1], step + 1)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    seconds = time.perf_counter() - start

    val_loss, val_accuracy = evaluate(model, data, device)
    writer.add_scalar("val/accuracy", val_accuracy, args.steps)
    writer.close()
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.save + ".tmp")
        os.replace(args.save + ".tmp", args.save)
    save_json({"script": NAME, "world_size": 1, "device": str(device), "config": cfg.to_dict(),
               "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
               "params": model.num_params(), "losses": losses, "val_loss": val_loss,
               "val_accuracy": val_accuracy, "train_seconds": seconds}, Path(args.run_dir) / "metrics.json")
    print(f"done: {args.steps} steps in {seconds:.1f} s, val loss {val_loss:.4f}, "
          f"exact answers {val_accuracy:.1%}", flush=True)
    if claim is not None:
        claim.release()  # the run directory is free for the next run


if __name__ == "__main__":
    main()
