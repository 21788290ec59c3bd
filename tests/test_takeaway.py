"""The take-home scripts run copied alone into an empty project: each script with only the course's data and
model code beside it (course/__init__.py empty, course/data.py, course/models.py) and course/errors.py, the fix
for torch's @record that the scripts import. Run on 2 gloo processes with plain torchrun (not the course's
launcher; train_single.py on 1); the copy's course/ shadows the installed course package, and its __pycache__ shows what was imported.
The same runs show that train_single.py and train_ddp.py learn and report as they should: each script is run once.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from course import ROOT, SCRIPTS

COPIED = ("__init__.py", "data.py", "errors.py", "models.py")  # what a learner copies beside the script
TINY_FLOWERS = 8  # images per class: 40 images, 32 training, 8 validation

RUNS = {  # script: (its arguments, the checkpoint it writes, relative to the project)
    "train_single.py": (["--max-steps", "150", "--epochs", "1"], "weights/train_single.pt"),
    "train_ddp.py": (["--max-steps", "100", "--epochs", "1", "--batch-size", "32"], "weights/train_ddp.pt"),
    "train_fsdp.py": (["--max-steps", "6", "--epochs", "1", "--batch-size", "32"], "weights/train_fsdp/.metadata"),
    "train_flowers.py": (["--epochs", "1", "--image-size", "32", "--global-batch", "8", "--batch-size", "4",
                          "--show-images", "4", "--log-every", "2"], "weights/train_flowers/last.pt"),
}


def project(tmp_path, script):
    """An empty folder holding the script and the course files a learner would copy with it, and nothing else."""
    root = tmp_path / "project"
    (root / "course").mkdir(parents=True)
    shutil.copy(SCRIPTS / script, root / script)
    for name in COPIED[1:]:
        shutil.copy(SCRIPTS / "course" / name, root / "course" / name)
    (root / "course" / "__init__.py").write_text("")  # empty: the course's own __init__ is not copied
    return root


def tiny_flowers(root):
    for name in ("daisy", "dandelion", "roses", "sunflowers", "tulips"):
        (root / name).mkdir(parents=True)
        for path in sorted((ROOT / "data" / "flowers" / name).glob("*.jpg"))[:TINY_FLOWERS]:
            shutil.copy(path, root / name / path.name)
    return root


@pytest.mark.parametrize("script", list(RUNS))
def test_a_take_home_script_runs_copied_alone(script, datasets, tmp_path):
    root = project(tmp_path, script)
    args, checkpoint = RUNS[script]
    data = tiny_flowers(tmp_path / "flowers") if script == "train_flowers.py" else datasets / "mnist"
    # No course setting, no extra import path; bytecode caching on, so that __pycache__ records the imports.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE"))}
    nproc = 1 if script == "train_single.py" else 2  # train_single.py is one process, under torchrun or not
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    result = subprocess.run([*torchrun, script, *args, "--data-dir", str(data), "--run-dir", "runs/mine"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])

    # Only the copy's course modules were imported: the copy's course/ shadows the installed package (which has
    # course.hardware, course.runlog, ...), and Python cached each module it imported from the copy.
    imported = {p.name.split(".")[0] for p in (root / "course" / "__pycache__").glob("*.pyc")}
    assert imported <= {name.removesuffix(".py") for name in COPIED}, imported
    assert {"data", "models", "errors"} <= imported, imported

    # What it wrote: relative to the working directory (the project), rank 0 only, nothing in the course folder.
    run_dir = root / "runs" / "mine"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1, "one writer: rank 0"
    assert metrics["script"] == script.removesuffix(".py") and metrics["world_size"] == nproc
    assert (metrics["backend"], metrics["device"]) == ("gloo" if nproc > 1 else None, "cpu")
    assert metrics["steps"] > 0 and metrics["timed_steps"] > 0 and metrics["samples_per_s"] > 0
    assert metrics["train_loss_history"] and 0 <= metrics["val_accuracy"] <= 1
    val_total = 8 if script == "train_flowers.py" else 10000 - (10000 % 2 if script == "train_fsdp.py" else 0)
    total = metrics.get("val_total", sum(map(sum, metrics.get("confusion", []))))
    assert total == val_total, "every validation image counted once"
    assert (root / checkpoint).is_file()
    if checkpoint.endswith(".pt"):
        state = torch.load(root / checkpoint, weights_only=True)
        assert not any(k.startswith("module.") for k in state["model"]), "the unwrapped model is saved"
    assert not list(root.rglob("*.tmp")), "no temporary file left"
    # Nothing of the copy reaches into the course: no run directory or checkpoint of this name there.
    assert not (ROOT / "runs" / "mine").exists()
    if script in LEARNS:
        LEARNS[script](metrics, result, torch.load(root / checkpoint, weights_only=True))


def single_learns(m, result, state):
    """150 steps of 64 on MNIST: learns; 3 warm-up steps untimed; the progress bar stopped by --max-steps ends
    full (150/150), never half drawn; the checkpoint is of step 150."""
    assert (m["world_size"], m["steps"], m["global_batch"], m["device"]) == (1, 150, 64, "cpu")
    assert m["val_accuracy"] > 0.85 and m["final_train_loss"] < 1.0
    assert (m["warmup_steps"], m["timed_steps"]) == (3, 147), "warm-up not timed"
    bars = [line for line in result.stderr.replace("\r", "\n").splitlines() if "%|" in line]
    assert bars and "100%" in bars[-1] and "150/150" in bars[-1], bars[-3:]
    assert "done:" in result.stdout and state["step"] == 150


def ddp_learns(m, result, state):
    """2 ranks x 32 = global batch 64 for 100 steps: learns; each rank says who it is; rank 0 alone reports."""
    assert (m["world_size"], m["backend"], m["batch_per_rank"], m["global_batch"]) == (2, "gloo", 32, 64)
    assert m["val_accuracy"] > 0.8 and m["timed_steps"] == 97
    assert "rank 0 (local rank 0) on cpu" in result.stdout and "rank 1 (local rank 1) on cpu" in result.stdout
    assert result.stdout.count("val accuracy") == 2  # the epoch line and the final line, from rank 0 only


LEARNS = {"train_single.py": single_learns, "train_ddp.py": ddp_learns}


def test_the_copied_course_files_import_nothing_else_of_the_course():
    """course/data.py, models.py and errors.py import torch, torchvision, numpy, PIL and the standard library only."""
    import ast

    for name in COPIED[1:]:
        tree = ast.parse((SCRIPTS / "course" / name).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {m for m in modules if m == "course" or m.startswith("course.")}, (name, modules)
    for script in RUNS:
        tree = ast.parse((SCRIPTS / script).read_text())
        course = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module and node.module.startswith("course")}
        assert course <= {"course.data", "course.models", "course.errors"}, (script, course)
