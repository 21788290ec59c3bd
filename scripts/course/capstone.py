"""Helpers of notebook 07 (the capstone) that are not its lesson: checking an image folder before training,
figures and image grids for TensorBoard, reading them back from event files, and the results table.

    from course.capstone import check_images, confusion_figure, denormalize
    check_images(train_set)                  # DatasetError naming the first unreadable file, before training
    writer.add_figure("val/confusion", confusion_figure(matrix, classes), step)
    images = read_images("runs/07_capstone_flowers/np2")   # {tag: [(step, HxWx3 uint8 array), ...]}
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import nn
from torchvision import models

from course import in_repo
from course.checkpoint import read_checkpoint
from course.data import IMAGENET_MEAN, IMAGENET_STD, DatasetError
from course.errors import CourseError

RESNETS = {"resnet18": models.resnet18, "resnet34": models.resnet34}  # random init: nothing is downloaded


def resnet(name: str, num_classes: int) -> nn.Module:
    """A torchvision ResNet with a ``num_classes`` head (the capstone's --model)."""
    model = RESNETS[name](num_classes=num_classes)
    model.course_name = name  # for error messages: "does not fit a resnet18"
    return model


def load_weights(path, model: nn.Module, device="cpu", skip: tuple[str, ...] = (), state=None) -> dict:
    """Load the weights in ``path`` (or its already read contents ``state``) into ``model``; return the contents.

    The file may be a plain state_dict (e.g. torchvision's ImageNet weights saved with torch.save) or a
    checkpoint dict with a "model" entry. Tensors whose names start with a prefix in ``skip`` (e.g. "fc."
    for a head that is replaced) are neither loaded nor required. Anything else that does not fit (a corrupt
    file, pickled code that weights_only=True refuses, another architecture) raises CourseError naming the
    file and the first tensor that differs: one line, not a traceback.
    """
    if state is None:
        state = read_checkpoint(path, device)
    weights = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CourseError(f"{path} holds no state_dict (a dict of tensors, or a checkpoint with a 'model' entry)")
    weights = {k.removeprefix("module."): v for k, v in weights.items() if not k.startswith(skip)}
    mine = {k: v for k, v in model.state_dict().items() if not k.startswith(skip)}
    differ = sorted(set(mine) ^ set(weights)) + [k for k in mine if k in weights and mine[k].shape != weights[k].shape]
    if differ:
        k = differ[0]
        shape = lambda d: tuple(d[k].shape) if k in d else "absent"
        name = getattr(model, "course_name", type(model).__name__)
        raise CourseError(f"{path} does not fit a {name} ({len(differ)} tensors differ; first {k}: "
                          f"{shape(weights)} in the file, {shape(mine)} in the model): another architecture?")
    model.load_state_dict(weights, strict=not skip)
    return state if isinstance(state, dict) and "model" in state else {"model": state}


def check_images(dataset) -> int:
    """Decode every image of an ImageFolder-based dataset (or a view of one) once, cheaply, before training:
    a DatasetError names the first file that cannot be read. Returns the number of files checked.

    JPEG draft mode decodes at 1/8 scale, which still reads every byte: a truncated file fails here
    (about 4000 small images/s on one core), not in the middle of an epoch on one rank.
    """
    while not hasattr(dataset, "samples") and hasattr(dataset, "base"):  # course.data's train/val views
        dataset = dataset.base
    for path, _ in dataset.samples:
        try:
            with Image.open(path) as image:
                image.draft("RGB", (16, 16))
                image.load()
        except (OSError, ValueError, SyntaxError) as error:  # PIL's ways of saying "not a readable image"
            raise DatasetError(f"unreadable image: {path} ({error}); delete or replace it") from None
    return len(dataset.samples)


def denormalize(images: torch.Tensor) -> torch.Tensor:
    """Normalized [N,3,H,W] images back to [0,1] for display (TensorBoard's add_images, matplotlib)."""
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float() * std + mean).clamp(0, 1)


def confusion_figure(matrix, classes, title: str = "validation confusion matrix"):
    """A matplotlib figure of a confusion matrix (rows: true class, columns: predicted), counts in cells."""
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")  # a training process has no display
    import matplotlib.pyplot as plt

    matrix = np.asarray(matrix)
    fig, ax = plt.subplots(figsize=(4.6, 4))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    high = matrix.max() / 2 if matrix.size else 0
    for (i, j), count in np.ndenumerate(matrix):
        ax.text(j, i, str(count), ha="center", va="center", fontsize=8, color="white" if count > high else "#222")
    fig.tight_layout()
    return fig


def read_images(run_dir, tags=None) -> dict[str, list[tuple[int, np.ndarray]]]:
    """{tag: [(step, HxWx3 uint8 array), ...]} of the image summaries (add_images, add_figure) in a run's
    event files, read with TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(in_repo(run_dir)), size_guidance={"images": 0})  # 0 = keep every one
    acc.Reload()
    found = {}
    for tag in acc.Tags()["images"]:
        if tags is None or tag in tags:
            found[tag] = [(event.step, np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB")))
                          for event in acc.Images(tag)]
    return found


def time_to_accuracy(history: list[dict], target: float) -> float | None:
    """Seconds of training and evaluation (start-up excluded) until the end of the first epoch whose validation
    accuracy reached ``target``; None if no epoch did. ``history``: metrics.json's per-epoch list."""
    for epoch in history:
        if epoch["val_accuracy"] >= target:
            return epoch["elapsed_s"]
    return None


def results_table(runs: dict[str, dict], target: float) -> list[dict]:
    """One row per run (name -> metrics): processes, global batch, samples/s, time to ``target``, final and
    best accuracy. Every figure is read from the run's metrics.json."""
    rows = []
    for name, m in runs.items():
        rows.append({"run": name, "processes": m["world_size"], "device": m["device"],
                     "global_batch": m["global_batch"], "accumulation": m["accumulation_steps"],
                     "samples_per_s": m["samples_per_s"], "epochs": m["epochs_done"],
                     "time_to_target_s": time_to_accuracy(m["history"], target),
                     "final_accuracy": m["val_accuracy"], "best_accuracy": m["best_accuracy"]})
    return rows


def format_table(rows: list[dict], target: float) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    header = (f"{'run':<8} {'procs':>5} {'device':>6} {'batch':>5} {'accum':>5} {'samples/s':>9} "
              f"{'s to ' + format(target, '.2f'):>9} {'final acc':>9} {'best acc':>8}")
    lines = [header]
    for r in rows:
        lines.append(f"{r['run']:<8} {r['processes']:>5} {r['device'].split(':')[0]:>6} {r['global_batch']:>5} "
                     f"{r['accumulation']:>5} {fmt(r['samples_per_s'], '.0f'):>9} "
                     f"{fmt(r['time_to_target_s'], '.1f'):>9} {r['final_accuracy']:>9.3f} {r['best_accuracy']:>8.3f}")
    return "\n".join(lines)
