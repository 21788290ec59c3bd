"""Helpers of notebook 07 (the capstone) that are not its lesson: reading image summaries back from event files,
and the results table. (load_weights, which predict.py uses too, lives in course.train_utils; the image check and
denormalize in course.data, the ResNets in course.models; train_flowers.py draws its own figures.)

    images = read_images("runs/07_capstone_flowers/np2")   # {tag: [(step, HxWx3 uint8 array), ...]}
    print(format_table(results_table({"np1": m1, "np2": m2}, target=0.75), 0.75))
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from course import in_repo
from course.data import check_images, denormalize  # noqa: F401 (their home is course.data; kept importable here)
from course.models import RESNETS, resnet  # noqa: F401 (their home is course.models)
from course.train_utils import load_weights  # noqa: F401 (its home is course.train_utils, which train_flowers.py uses)


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
