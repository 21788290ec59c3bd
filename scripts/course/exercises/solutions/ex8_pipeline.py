# Reference solution of exercise 8 of notebooks/11_pipeline_parallel.ipynb: look after you have tried.
"""Exercise 8: GPipe by hand on 2 processes. The small GPT cut in two stages, one step over micro-batches.

Fill the lines marked TODO, then run `exercises.check("8")` in notebook 11. The check launches this script
on 2 processes with a seed and batch that are not the defaults and compares every rank's gradients, after
one GPipe step, with the whole model's on one process.

    torchrun --nproc-per-node=2 scripts/ex8_pipeline.py --out runs/11_pipeline_parallel/ex8
"""
import argparse
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from course.gpt import GPT, GPTConfig, loss_fn
from course.gpt_stages import GPTStage
from course.lm_data import load_lm_data


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/11_pipeline_parallel/ex8", help="where each rank saves its gradients")
    parser.add_argument("--timeout", type=float, default=60, help="process-group timeout, seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))  # CPU tensors, any machine
    rank, m = dist.get_rank(), args.microbatches
    data = load_lm_data()
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size)
    torch.manual_seed(args.seed)
    stage = GPTStage(GPT(cfg), rank, 2)  # rank 0: embeddings + block 0; rank 1: block 1, ln_f, head
    x, y = data.batch("train", 0, args.batch_size, args.seed)
    shape = (args.batch_size // m, cfg.block_size, cfg.n_embd)  # one micro-batch's activations

    outputs, inputs = [], []
    for xm, ym in zip(x.chunk(m), y.chunk(m)):  # all forwards
        if rank == 0:
            out = stage(xm)
            dist.send(out.detach(), dst=1)
            outputs.append(out)
        else:
            h = torch.empty(shape)
            dist.recv(h, src=0)
            h.requires_grad_()
            loss = loss_fn(stage(h), ym) / m  # each micro-batch's share of the batch's mean loss
            inputs.append(h)
            outputs.append(loss)
    for i in range(m):  # all backwards, micro-batch 0 first on both ranks
        if rank == 1:
            outputs[i].backward()
            dist.send(inputs[i].grad, dst=0)  # the gradient of stage 1's input, back to stage 0
        else:
            grad = torch.empty(shape)
            dist.recv(grad, src=1)
            outputs[i].backward(grad)  # stage 0's backward, from the gradient of its output

    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save({name: p.grad for name, p in stage.named_parameters()}, Path(args.out) / f"ex8_rank{rank}.pt")
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
