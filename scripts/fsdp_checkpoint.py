# Written by notebooks/08_sharding_fsdp.ipynb - edit it there; running the notebook rewrites this file.
"""Load a sharded checkpoint (the folder train_fsdp.py writes) on any number of ranks, evaluate it, export it.

torch.distributed.checkpoint (DCP) stores every tensor as pieces, each with its offset in the whole tensor,
so a folder written by 2 ranks loads onto 1, 3 or 4: each rank reads the parts of the pieces that overlap
its own shard. With --export, rank 0 then writes one ordinary file that a plain single-device script loads
with torch.load(path, weights_only=True).

    torchrun --standalone --nproc-per-node=1 scripts/fsdp_checkpoint.py weights/train_fsdp --export weights/train_fsdp.pt
    torchrun --standalone --nproc-per-node=2 scripts/fsdp_checkpoint.py weights/train_fsdp --model cnn  # if saved so
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

from course.args import JobParser, repo_output_dir, repo_path, repo_writable_file
from course.checkpoint import save_checkpoint
from course.dcp_check import WeightsOnlyPlanner, load_failure, problem, read_metadata, unverified
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.runlog import RunLog
from course.sharding import local_bytes


@record
def main():
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=repo_path, help="a DCP folder written by train_fsdp.py")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="as when it was saved")
    parser.add_argument("--data-dir", type=repo_path, default="data/mnist", help="holds MNIST/raw/ (validation)")
    parser.add_argument("--export", type=repo_writable_file, help="write the whole model here, as one ordinary file")
    parser.add_argument("--run-dir", type=repo_output_dir, default="runs/fsdp_checkpoint")
    args = parser.parse_args()
    world_size = parser.world_size()  # outside torchrun: one line saying how to launch it
    # Nothing in the folder runs as code: sha256.json, then DCP's own classes only, then every item that is not
    # a tensor with torch's weights-only unpickler (data only). dcp.load below reads them the same way.
    if (why := problem(args.checkpoint)) is not None:
        parser.error(f"argument checkpoint: {why}")

    rank = int(os.environ["RANK"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:  # as train_fsdp.py reads it
        val_set = datasets.MNIST(args.data_dir, train=False, transform=normalize)
    except RuntimeError as error:  # "Dataset not found": one line, before the group starts
        parser.error(f"argument --data-dir: {args.data_dir}: {error}")
    with reported_once(rank):  # a busy run directory: one line, before the group starts
        log = RunLog(args.run_dir, enabled=rank == 0, script="fsdp_checkpoint", world_size=world_size,
                     checkpoint=str(args.checkpoint), export=str(args.export) if args.export else None)
    dist.init_process_group(backend_for(device))
    mesh = init_device_mesh(device.type, (world_size,))

    # train_fsdp.py's model, sharded the same way, but over *this* job's ranks; and the same kind of optimizer,
    # so that its state (SGD's momentum) has somewhere to go.
    if args.model == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    else:
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    model = model.to(device)
    for layer in model:  # the layers that hold weights, then the root
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # What to fill: this rank's shards, named as in the plain model. dcp.load reads into them in place.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "epoch": torch.tensor(-1), "step": torch.tensor(-1)}
    if rank == 0 and (note := unverified(args.checkpoint)) is not None:
        print(note, flush=True)
    try:
        dcp.load(state, checkpoint_id=args.checkpoint, planner=WeightsOnlyPlanner())  # non-tensors: data only
    except dcp.CheckpointException as error:  # raised on every rank alike: another model's checkpoint, say
        if rank == 0:
            print(f"error: {load_failure(args.checkpoint, error)}", file=sys.stderr, flush=True)
        dist.barrier()  # every rank got it; all leave together: gloo's exit race, notebook 03
        dist.destroy_process_group()
        raise SystemExit(2) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    epoch, step = int(state["epoch"]), int(state["step"])  # saved as tensors by train_fsdp.py

    # Where the pieces came from: the metadata lists, for each tensor, the pieces the saving ranks wrote.
    name, param = next(iter(model.named_parameters()))
    pieces = read_metadata(args.checkpoint).state_dict_metadata[f"model.{name}"].chunks
    print(f"rank {rank}: {name} {list(param.shape)} was saved as {len(pieces)} piece(s) of rows "
          f"{[(p.offsets[0], p.offsets[0] + p.sizes[0]) for p in pieces]}; this rank now holds "
          f"{list(param.to_local().shape)}; {local_bytes(model.parameters())} bytes of parameters here", flush=True)

    # Evaluate as train_fsdp.py does: every rank the same number of images, counts summed over the ranks.
    end = len(val_set) - len(val_set) % world_size
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    with torch.no_grad():
        for images, labels in DataLoader(Subset(val_set, range(rank, end, world_size)), 256):
            images, labels = images.to(device), labels.to(device)
            counts += torch.stack([(model(images).argmax(1) == labels).sum(), torch.tensor(len(labels), device=device)])
    dist.all_reduce(counts)
    correct, total = counts.tolist()

    # Export: gather every shard into whole tensors on rank 0's CPU memory (a collective: every rank calls it).
    if args.export:
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_checkpoint({"model": whole, "epoch": epoch, "step": step}, args.export)
    if rank == 0:
        print(f"loaded step {step} (epoch {epoch}) on {world_size} rank(s): "
              f"val accuracy {correct / total:.4f} ({correct}/{total})"
              + (f"; exported to {args.export}" if args.export else ""), flush=True)
    log.finish(step=step, epoch=epoch, saved_pieces=len(pieces), val_correct=correct,
               val_total=total, val_accuracy=correct / total)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
