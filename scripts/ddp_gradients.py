"""Check that DDP's averaged gradient equals the single-process gradient of the whole batch.

Every rank computes the reference itself (a plain copy of the model on the full batch), then the
DDP model on its own 1/world_size slice of that batch; after backward() DDP has averaged the slices'
gradients. With no BatchNorm the two agree to float rounding; with BatchNorm they differ, because each
rank normalises with the statistics of its own slice.

    torchrun --standalone --nproc-per-node=2 scripts/ddp_gradients.py --model mlp
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from course.data import build_datasets
from course.hardware import backend_for, pick_device
from course.models import build_model
from course.runlog import RunLog


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet18"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=64, help="the whole batch, split across ranks")
    parser.add_argument("--run-dir", default="runs/ddp_gradients")
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device))

    dataset = "mnist" if args.model == "mlp" else "flowers"
    _, val_set, num_classes = build_datasets(dataset)  # validation transforms: no random augmentation
    images, labels = map(torch.stack, zip(*[(x, torch.as_tensor(y)) for x, y in
                                            (val_set[i] for i in range(args.batch_size))]))
    images, labels = images.to(device), labels.to(device)

    torch.manual_seed(0)
    model = build_model(args.model, num_classes).to(device)
    reference = copy.deepcopy(model)  # a plain model, outside DDP
    nn.functional.cross_entropy(reference(images), labels).backward()  # the whole batch in one process

    ddp_model = DDP(model)
    shard = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    nn.functional.cross_entropy(ddp_model(images[shard]), labels[shard]).backward()  # DDP averages here

    diffs = {name: (p.grad - r.grad).abs().max().item()
             for (name, p), r in zip(model.named_parameters(), reference.parameters())}
    scale = max(r.grad.abs().max().item() for r in reference.parameters())
    worst = max(diffs, key=diffs.get)
    print(f"rank {rank}: largest |grad difference| {diffs[worst]:.2e} in {worst} "
          f"(largest gradient entry {scale:.2e})", flush=True)
    RunLog(args.run_dir, enabled=rank == 0, script="ddp_gradients", world_size=world_size, model=args.model,
           batch=args.batch_size, device=str(device)).finish(
        max_abs_grad_diff=diffs[worst], worst_parameter=worst, max_abs_grad=scale, per_parameter=diffs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
