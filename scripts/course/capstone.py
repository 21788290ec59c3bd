"""Helpers of notebook 07 (the capstone) that are not its lesson: launching train_flowers.py with rank 0's summary
lines shown, a folder of images for predict.py, reading image summaries back from event files, the results
table and what its CPU ratio of 2 processes to 1 compares. (load_weights lives in course.train_utils, beside
train_flowers.py; the image check and denormalize in course.data, the ResNets in course.models; train_flowers.py
draws its own figures.)

    metrics = launch_flowers(run_dir, checkpoint_dir, 2, ["--epochs", 2], threads=1)  # prints rank 0's epoch lines
    folder, truth = predict_demo(image_folder, "runs/07_capstone_flowers/predict_demo")  # 8 validation images
    images = read_images("runs/07_capstone_flowers/np2")   # {tag: [(step, HxWx3 uint8 array), ...]}
    print(format_table(results_table({"np1": m1, "np2": m2}, target=0.75), 0.75))
    print(threads_note(cpu_threads_rule(2), m1, m2))  # on a CPU: what the 1-vs-2 ratio compares
"""

from __future__ import annotations

import io
import shutil

import numpy as np
from PIL import Image

from course import in_repo
from course.data import check_images, denormalize, split_indices  # noqa: F401 (the first two: importable here too)
from course.models import RESNETS, resnet  # noqa: F401 (their home is course.models)

SUMMARY = ("train_flowers:", "epoch", "note:", "resumed", "backbone", "done:")  # rank 0's lines worth showing


def launch_flowers(run_dir, checkpoint_dir, nproc: int, args, *, backend: str = "auto", threads: int | None = None,
                   timeout: float = 900) -> dict:
    """train_flowers.py on ``nproc`` processes through course.launcher (a timeout, no process left behind, the failing
    rank's error), printing rank 0's summary lines only (no progress bars); its metrics.json. ``threads``: the
    OMP_NUM_THREADS of each process (None: the launcher's)."""
    from course.launcher import launch

    def on_line(line):
        text = line.removeprefix("[rank0]:").strip()
        if line.startswith("[rank0]:") and text.startswith(SUMMARY) and "%|" not in text:  # "%|": a progress bar
            print(text)

    result = launch("train_flowers.py", nproc, [*map(str, args), "--checkpoint-dir", str(checkpoint_dir)],
                    backend=backend, run_dir=run_dir, timeout=timeout, quiet=True, on_line=on_line,
                    env={"OMP_NUM_THREADS": str(threads)} if threads else None)
    print(f"[{nproc} process(es), {result.wall_time:.0f} s; {in_repo(run_dir).name}/metrics.json]")
    return result.metrics


def predict_demo(folder, out, n: int = 8) -> tuple:
    """(out, {file name: true class}): ``n`` validation images of the ImageFolder ``folder``, spread over the
    classes, copied into the fresh folder ``out`` under names that carry their class."""
    out = in_repo(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _, val_indices = split_indices(len(folder))
    truth = {}
    for i in val_indices[:: len(val_indices) // n][:n]:
        path, label = folder.samples[i]
        name = f"{i:04d}_{folder.classes[label]}.jpg"
        shutil.copy(path, out / name)
        truth[name] = folder.classes[label]
    return out, truth


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


def threads_note(rule, one: dict, many: dict) -> str:
    """What notebook 07's CPU comparison of 1 process with N compares, from the two runs' metrics.json and the
    thread rule they ran under (``course.measure.cpu_threads_rule``): the ratio measured, and how the two runs
    split the same work differently. It names what can slow either, never which did (one run each: no verdict).
    "" when the 1 process has a single thread (then both runs use one thread per process)."""
    if rule.one_process_threads <= 1 or not (one.get("samples_per_s") and many.get("samples_per_s")):
        return ""
    n, per = many["world_size"], rule.n_process_threads

    def work(m):
        k, b = m["accumulation_steps"], m["micro_batch"]
        return f"{k} micro-batch{'es' if k > 1 else ''} of {b}"

    return (f"{n} processes ran at {many['samples_per_s'] / one['samples_per_s']:.2f}x the samples/s of 1 (one run "
            f"each). They split the same step differently: 1 process computes {work(one)} in turn, each operation "
            f"split over its {rule.one_process_threads} threads; {n} processes compute {work(many)} each at the same "
            f"time, on {per} thread{'s' if per > 1 else ''} each, then all-reduce the gradients. Either can lose "
            "time: a thread that waits for another whose core some other program took slows every step of its "
            f"process (notebook 01), and the all-reduce adds to every step of the {n} processes. So this ratio is "
            "not DDP's alone; notebook 03's speed section compares 1 rank with 2 at one thread each, in interleaved "
            "rounds.")
