# Written by notebooks/03_ddp_five_steps.ipynb - edit it there; running the notebook rewrites this file.
"""Check that DDP's averaged gradient equals the single-process gradient of the whole batch.

Every rank computes the reference itself (a plain copy of the model on the full batch), then the
DDP model on its own 1/world_size slice of that batch; after backward() DDP has averaged the slices'
gradients. With no BatchNorm the two agree to float rounding; with BatchNorm they differ, because each
rank normalises with the statistics of its own slice.

    torchrun --standalone --nproc-per-node=2 scripts/ddp_gradients.py --models mlp cnn
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.args import positive_int, repo_path
from course.data import build_datasets
from course.errors import record, reported_once
from course.hardware import backend_for, pick_device
from course.models import build_model
from course.runlog import RunLog


def compare(name, device, batch_size, rank, world_size):
    """{parameter: max |DDP grad - full-batch grad|} and the largest full-batch gradient entry."""
    dataset = "mnist" if name == "mlp" else "flowers"
    _, val_set, num_classes = build_datasets(dataset)  # validation transforms: no random augmentation
    images, labels = map(torch.stack, zip(*[(x, torch.as_tensor(y)) for x, y in
                                            (val_set[i] for i in range(batch_size))]))
    images, labels = images.to(device), labels.to(device)

    torch.manual_seed(0)
    model = build_model(name, num_classes).to(device)
    reference = copy.deepcopy(model)  # a plain model, outside DDP
    nn.functional.cross_entropy(reference(images), labels).backward()  # the whole batch in one process

    ddp_model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    shard = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
    nn.functional.cross_entropy(ddp_model(images[shard]), labels[shard]).backward()  # DDP averages here

    diffs = {n: (p.grad - r.grad).abs().max().item()
             for (n, p), r in zip(model.named_parameters(), reference.parameters())}
    return diffs, max(r.grad.abs().max().item() for r in reference.parameters())


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=["mlp", "cnn", "resnet18"], default=["mlp", "cnn"])
    parser.add_argument("--batch-size", type=positive_int, default=64, help="the whole batch, split across ranks")
    parser.add_argument("--run-dir", type=repo_path, default="runs/ddp_gradients")
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    with reported_once(rank):  # a missing dataset or a busy run directory: one line, before the group starts
        for name in args.models:
            build_datasets("mnist" if name == "mlp" else "flowers")
        log = RunLog(args.run_dir, enabled=rank == 0, script="ddp_gradients", world_size=world_size,
                     model_names=args.models, batch=args.batch_size, device=str(device))
    dist.init_process_group(backend_for(device))

    results = {}
    for name in args.models:
        diffs, scale = compare(name, device, args.batch_size, rank, world_size)
        worst = max(diffs, key=diffs.get)
        results[name] = {"max_abs_grad_diff": diffs[worst], "worst_parameter": worst, "max_abs_grad": scale,
                         "per_parameter": diffs}
        print(f"rank {rank}, {name}: largest |grad difference| {diffs[worst]:.2e} in {worst} "
              f"(largest gradient entry {scale:.2e})", flush=True)
    log.finish(models=results)
    dist.barrier()  # every rank done before any leaves: gloo's exit race, notebook 03
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
