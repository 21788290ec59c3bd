"""Helpers of notebook 07 (the capstone) that are not its lesson: loading weights a learner names (predict.py),
reading image summaries back from event files, and the results table. (The image check and denormalize live
in course.data, the ResNets in course.models; train_flowers.py draws its own figures.)

    load_weights("weights/train_flowers/best.pt", model)   # CourseError naming the file if it does not fit
    images = read_images("runs/07_capstone_flowers/np2")   # {tag: [(step, HxWx3 uint8 array), ...]}
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import nn

from course import in_repo
from course.checkpoint import read_checkpoint
from course.data import check_images, denormalize  # noqa: F401 (their home is course.data; kept importable here)
from course.errors import CourseError
from course.models import RESNETS, resnet  # noqa: F401 (their home is course.models)


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
