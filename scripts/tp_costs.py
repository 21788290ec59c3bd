# Written by notebooks/10_tensor_parallel.ipynb - edit it there; running the notebook rewrites this file.
"""What tensor parallelism costs on each rank: collectives and bytes of one training step, and memory.

    torchrun --nproc-per-node=2 scripts/tp_costs.py [--sequence-parallel]

Builds train_tp.py's model with its own plan, runs one step under course.comm_count's counter (forward,
backward and optimizer step counted apart, the whole model and one block alone), and measures per rank:
parameters, gradients, AdamW's state and the activations saved for backward (every tensor autograd
keeps, counted once, parameters excluded). metrics.json in --run-dir holds it all, from rank 0.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import parallel as tp

from course import flag
from course.args import JobParser, check_gpt_size, output_dir, positive_int
from course.comm_count import CollectiveCounter, predict_block, predict_tp_step
from course.errors import reported_once
from course.gpt import GPT, GPTConfig, loss_fn
from course.lm_data import DataError, load_lm_data
from course.rundir import claim_run_dir
from train_tp import pick_device, tensor_parallel


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(tensors):
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


class SavedTensors:
    """Bytes of the distinct tensors autograd saves for backward, by the module that saved them."""

    def __init__(self, model, exclude):
        self.seen, self.by_owner, self.stack = set(), {}, ["loss"]  # outside the model: the loss
        self.exclude = {local(p).data_ptr() for p in exclude}
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda m, a, name=name: self.enter(name.split(".")[-1]))
            module.register_forward_hook(lambda m, a, out: self.leave())

    def enter(self, name):
        self.stack.append(name)

    def leave(self):
        self.stack.pop()

    def pack(self, t):
        lt = local(t)
        key = (lt.data_ptr(), lt.numel())
        if lt.data_ptr() not in self.exclude and key not in self.seen and lt.numel() > 0:
            self.seen.add(key)
            kind = self.stack[-1] or "model"
            self.by_owner[kind] = self.by_owner.get(kind, 0) + lt.numel() * lt.element_size()
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--n-layer", type=positive_int, default=2)
    parser.add_argument("--n-embd", type=positive_int, default=64)
    parser.add_argument("--run-dir", type=output_dir, default="runs/tp_costs")
    args = parser.parse_args()
    world, heads = parser.world_size(), GPTConfig.n_head  # checked before the process group: one error line
    if args.n_embd % heads:
        parser.error(f"argument --n-embd: {args.n_embd} does not split into the model's {heads} heads of equal width")
    if heads % world:
        parser.error(f"torchrun --nproc-per-node: the model's {heads} heads do not split over {world} processes")
    try:
        data = load_lm_data(batch_size=args.batch_size)
    except DataError as error:
        parser.error(f"argument {error.flag}: {error}")
    check_gpt_size(parser, args, data)  # before any allocation: "needs about X GB, this machine has Y GB"
    if args.sequence_parallel and data.block_size % world:
        parser.error(f"argument --sequence-parallel: the {data.block_size} positions of a sample do not split over "
                     f"{world} processes")
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    rank = int(os.environ["RANK"])  # rank 0 writes --run-dir, so it claims it (staged: the launcher does)
    with reported_once(rank):  # one live run per --run-dir (course.rundir): a second one gets one error line
        claim = None if rank or flag("COURSE_STAGED") else claim_run_dir(args.run_dir)
    dist.init_process_group(dist.get_default_backend_for_device(device.type))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size, n_layer=args.n_layer,
                    n_embd=args.n_embd)
    x, y = (t.to(device) for t in data.batch("train", 0, args.batch_size))

    torch.manual_seed(0)
    plain = GPT(cfg).to(device)  # the one-process model: what each rank would hold without TP
    saved_plain = SavedTensors(plain, plain.parameters())
    with saved_plain.context():
        loss_fn(plain(x), y).backward()

    torch.manual_seed(0)
    model = tensor_parallel(GPT(cfg).to(device), mesh, args.sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter, saved = CollectiveCounter(world), SavedTensors(model, model.parameters())
    with tp.loss_parallel():
        with counter.phase("forward"), saved.context():
            loss = loss_fn(model(x), y)
        with counter.phase("backward"):
            loss.backward()
    with counter.phase("optimizer"):
        optimizer.step()

    # The last block alone, on what it receives in the model: its own collectives and nothing else.
    block_counter = CollectiveCounter(world)
    h = torch.randn(args.batch_size, cfg.block_size, cfg.n_embd, device=device)
    if args.sequence_parallel:
        h = h.chunk(world, dim=1)[rank]  # sequence parallel: each rank holds its positions between blocks
    h.requires_grad_(True)
    with block_counter.phase("forward"):
        out = model.blocks[-1](h)  # not blocks[0]: with sequence parallelism that one also cuts its input
    with block_counter.phase("backward"):
        local(out).sum().backward()

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    result = {
        "world_size": world, "sequence_parallel": args.sequence_parallel, "config": cfg.to_dict(),
        "batch_size": args.batch_size, "tokens": args.batch_size * cfg.block_size,
        "step": counter.summary(), "block": block_counter.summary(),
        "predicted_step": predict_tp_step(cfg.n_layer, args.batch_size * cfg.block_size, cfg.n_embd,
                                          args.sequence_parallel),
        "predicted_block": predict_block(args.batch_size * cfg.block_size, cfg.n_embd, args.sequence_parallel),
        "bytes_per_rank": {"parameters": nbytes(params), "gradients": nbytes(p.grad for p in params),
                           "optimizer_state": nbytes(state), "activations": sum(saved.by_owner.values())},
        "one_process": {"parameters": nbytes(plain.parameters()), "activations": sum(saved_plain.by_owner.values()),
                        "activations_by_owner": saved_plain.by_owner},
        "activations_by_owner": saved.by_owner,
        "replicated_parameters": nbytes(p for p in params if not isinstance(p, DTensor)
                                        or all(pl.is_replicate() for pl in p.placements)),
    }
    if rank == 0:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.run_dir) / "metrics.json.tmp").write_text(json.dumps(result, indent=2))
        os.replace(Path(args.run_dir) / "metrics.json.tmp", Path(args.run_dir) / "metrics.json")
        print(json.dumps({k: result[k] for k in ("step", "block", "bytes_per_rank")}), flush=True)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    if claim is not None:
        claim.release()  # the run directory is free for the next run
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
