# Written by notebooks/07_capstone_flowers.ipynb - edit it there; running the notebook rewrites this file.
"""Classify images with a checkpoint of train_flowers.py, on whatever device this machine has.

    python scripts/predict.py path/to/folder_or_image ...                        # weights/train_flowers/best.pt
    python scripts/predict.py photos/ --checkpoint weights/train_flowers/last.pt --top 2

Prints one line per image: its path, the predicted class and its probability. The checkpoint names the
architecture, the image size and the classes it was trained with; a file of another architecture, or one
that is not a checkpoint, stops with one line naming it.
"""
import argparse
from pathlib import Path

import torch
from torchvision.datasets.folder import IMG_EXTENSIONS

from course.args import positive_int, repo_path
from course.checkpoint import read_checkpoint
from course.data import flower_transforms, load_image
from course.errors import CourseError, reported_once
from course.hardware import pick_device
from course.models import RESNETS, resnet
from course.train_utils import load_weights


def image_files(paths: list[Path]) -> list[Path]:
    """The image files named, and those inside the folders named (sorted); CourseError if there are none."""
    files = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix.lower() in IMG_EXTENSIONS)
        elif path.is_file():
            files.append(path)
        else:
            raise CourseError(f"no such file or folder: {path}")
    if not files:
        raise CourseError(f"no images ({', '.join(IMG_EXTENSIONS)}) in {', '.join(map(str, paths))}")
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="image files or folders of images")
    parser.add_argument("--checkpoint", type=repo_path, default="weights/train_flowers/best.pt")
    parser.add_argument("--top", type=positive_int, default=1, help="classes shown per image")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    args = parser.parse_args()
    device = pick_device()  # one plain process: an accelerator if there is one (MPS too), else the CPU

    with reported_once():  # a bad checkpoint or path: one "error: ..." line, exit status 2
        if not args.checkpoint.is_file():
            raise CourseError(f"no checkpoint at {args.checkpoint}; train first (scripts/train_flowers.py)")
        # weights_only=True and map_location: tensors saved on any device load onto this one, and no code runs
        state = read_checkpoint(args.checkpoint, device)
        config = state.get("config") if isinstance(state, dict) else None
        if not isinstance(config, dict) or config.get("model") not in RESNETS:
            raise CourseError(f"{args.checkpoint} is not a train_flowers.py checkpoint (it has no 'config' entry "
                              "naming the model, image size and classes)")
        classes = config["classes"]
        model = resnet(config["model"], len(classes)).to(device)
        load_weights(args.checkpoint, model, device, state=state)
        files = image_files(args.paths)
        size = config["image_size"]
        _, transform = flower_transforms(size)  # the validation transform: what the model was evaluated on
        images = [transform(load_image(str(path))) for path in files]  # an unreadable file: one line naming it
    model.eval()
    print(f"{args.checkpoint.name}: {config['model']}, {size} px, classes {', '.join(classes)}; on {device}")
    with torch.inference_mode():
        for start in range(0, len(files), args.batch_size):
            batch = torch.stack(images[start:start + args.batch_size]).to(device)
            probabilities = model(batch).softmax(1).cpu()
            for path, p in zip(files[start:start + args.batch_size], probabilities):
                top = p.topk(min(args.top, len(classes)))
                guesses = ", ".join(f"{classes[i]} {v:.3f}" for v, i in zip(top.values.tolist(), top.indices.tolist()))
                print(f"{path}: {guesses}")


if __name__ == "__main__":
    main()
