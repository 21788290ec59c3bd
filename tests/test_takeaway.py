"""The take-home scripts run copied alone into an empty project, with plain torchrun (not the course's launcher).

The core path's scripts (train_single.py, train_ddp.py) are plain PyTorch: copied alone into an empty folder, run
on 1 and 2 gloo processes in an environment where importing ``course`` fails, they train, learn and report as they
should (each run once). train_fsdp.py (notebook 08) is plain PyTorch too: copied alone, on 2 ranks, its DCP
folder verifies against its sha256.json and joins into the plain model. The deep dives' take-home scripts come with exactly the files their docstring says to copy
(course/__init__.py empty, course/data.py, course/models.py, course/train_utils.py), in an environment where the
course itself is importable too: the copy's course/ must win, and its __pycache__ shows what was imported. Then the
newcomer's mistakes: the course/__init__.py left out, no --data-dir outside the course, python train_ddp.py without
torchrun.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from course import ROOT, SCRIPTS

TAKE_HOME = ("train_single.py", "train_ddp.py", "train_fsdp.py", "train_flowers.py", "train_resumable.py",
             "train_dp.py")
CORE = ("train_single.py", "train_ddp.py")  # the core path's: torch, torchvision and tensorboard, nothing else
PLAIN = (*CORE, "train_dp.py", "train_resumable.py", "train_fsdp.py")  # and those whose diff from a core script is the lesson
TINY_FLOWERS = 8  # images per class: 40 images, 32 training, 8 validation

RUNS = {  # script: (its arguments, the checkpoint it writes, relative to the project)
    "train_flowers.py": (["--epochs", "1", "--image-size", "32", "--global-batch", "8", "--batch-size", "4",
                          "--show-images", "4", "--log-every", "2"], "weights/train_flowers/last.pt"),
}


def files_to_copy(script):
    """The course files the script's own docstring (its --help) tells a learner to copy beside it."""
    doc = (SCRIPTS / script).read_text().split('"""')[1]
    return re.findall(r"course/\w+\.py", doc)


def project(tmp_path, script, init=True):
    """An empty folder holding the script and the course files its docstring names, and nothing else."""
    root = tmp_path / "project"
    (root / "course").mkdir(parents=True)
    shutil.copy(SCRIPTS / script, root / script)
    for name in files_to_copy(script):
        if name == "course/__init__.py":
            if init:
                (root / name).write_text("")  # empty, as the docstring says: the course's own is not copied
        else:
            shutil.copy(SCRIPTS / name, root / name)
    return root


def environment():
    """No course setting; the course importable (as where it is installed); bytecode caching on, so that
    __pycache__ records the imports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "PYTHONDONTWRITEBYTECODE"))}
    return {**env, "PYTHONPATH": str(SCRIPTS)}


def without_the_course(tmp_path):
    """No course setting, and a ``course`` package first on the path whose import fails: a plain script that
    imported anything of the course would stop."""
    poison = tmp_path / "poison" / "course"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('a plain script imported the course')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COURSE_")}
    return {**env, "PYTHONPATH": str(poison.parent)}


def test_the_core_scripts_import_torch_torchvision_tensorboard_and_the_standard_library_only():
    import ast

    for script in PLAIN:
        tree = ast.parse((SCRIPTS / script).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        outside = {m for m in modules if m.split(".")[0] not in {"torch", "torchvision"} | set(sys.stdlib_module_names)}
        assert not outside, (script, outside)
        assert "course/" not in (SCRIPTS / script).read_text().split('"""')[1], f"{script}: nothing to copy beside it"


@pytest.mark.parametrize("script", CORE)
def test_a_core_script_runs_copied_alone_into_an_empty_folder(script, datasets, tmp_path):
    """train_single.py on 1 process, train_ddp.py on 2 (32 each: global batch 64), under plain torchrun from an
    empty folder holding only the script: they learn, rank 0 alone writes, the checkpoint holds the unwrapped
    model, and everything lands relative to the working directory."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(SCRIPTS / script, root / script)
    nproc, batch = (1, 64) if script == "train_single.py" else (2, 32)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    args = ["--max-steps", "150", "--epochs", "1", "--batch-size", str(batch), "--log-every", "50"]
    result = subprocess.run([*torchrun, script, *args, "--data-dir", str(datasets / "mnist"), "--run-dir",
                             "runs/mine"], cwd=root, env=without_the_course(tmp_path), capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    m = json.loads((root / "runs" / "mine" / "metrics.json").read_text())
    assert len(list((root / "runs" / "mine").glob("events.out.tfevents.*"))) == 1, "one writer: rank 0"
    assert (m["world_size"], m["steps"], m["global_batch"], m["device"]) == (nproc, 150, 64, "cpu")
    assert m["val_accuracy"] > 0.85 and m["train_loss_history"][-1][1] < m["train_loss_history"][0][1] < 5
    assert m["val_total"] == 10000 and m["samples_per_s"] > 0, "every validation image counted once"
    assert [s for s, _ in m["train_loss_history"]] == [50, 100, 150]
    state = torch.load(root / "weights" / script.replace(".py", ".pt"), weights_only=True)
    assert state["step"] == 150 and not any(k.startswith("module.") for k in state["model"])
    assert not list(root.rglob("*.tmp")), "no temporary file left"
    assert result.stdout.count("val accuracy") == 2, "the epoch line and the last line, from rank 0 only"
    if nproc == 2:
        assert m["backend"] == "gloo"
        assert "rank 0 (local rank 0) on cpu" in result.stdout and "rank 1 (local rank 1) on cpu" in result.stdout
    assert not (ROOT / "runs" / "mine").exists()


def test_train_fsdp_runs_copied_alone_into_an_empty_folder(datasets, tmp_path):
    """train_fsdp.py on 2 gloo processes (32 each) under plain torchrun from an empty folder holding only the
    script, importing the course impossible: it learns, rank 0 alone writes the run directory, every rank its
    shards; the folder's sha256.json is what the course writes and checks (course.dcp_check), and the folder
    joins into one file that the plain nn.Sequential loads."""
    from torch import nn

    from course.dcp_check import MANIFEST, dcp_to_torch_save, problem, unverified
    from course.train_utils import write_manifest

    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(SCRIPTS / "train_fsdp.py", root)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args = ["--max-steps", "100", "--epochs", "1", "--batch-size", "32", "--log-every", "50"]
    result = subprocess.run([*torchrun, "train_fsdp.py", *args, "--data-dir", str(datasets / "mnist"), "--run-dir",
                             "runs/mine"], cwd=root, env=without_the_course(tmp_path), capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    m = json.loads((root / "runs" / "mine" / "metrics.json").read_text())
    assert len(list((root / "runs" / "mine").glob("events.out.tfevents.*"))) == 1, "one writer: rank 0"
    assert (m["world_size"], m["backend"], m["device"], m["steps"], m["global_batch"]) == (2, "gloo", "cpu", 100, 64)
    assert (m["bf16"], m["reshard_after_forward"]) == (False, True)  # a CPU: fp32
    assert m["val_accuracy"] > 0.8 and m["train_loss_history"][-1][1] < m["train_loss_history"][0][1] < 5
    assert m["val_total"] == 10000 and [s for s, _ in m["train_loss_history"]] == [50, 100]
    assert result.stdout.count("val accuracy") == 2, "the epoch line and the last line, from rank 0 only"

    folder = root / "weights" / "train_fsdp"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST]
    assert problem(folder) is None and unverified(folder) is None  # its manifest checks out
    ours = (folder / MANIFEST).read_text()
    assert json.loads(ours) == json.loads(write_manifest(folder, "course.json").read_text())  # the course's format
    dcp_to_torch_save(folder, tmp_path / "joined.pt")
    joined = torch.load(tmp_path / "joined.pt", weights_only=True)
    assert int(joined["step"]) == 100 and int(joined["epoch"]) == 0
    plain = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    plain.load_state_dict(joined["model"])  # strict: the plain model's names, whole tensors
    assert not list(root.rglob("*.tmp")), "no temporary file left"
    assert not (ROOT / "runs" / "mine").exists()


def tiny_flowers(root):
    for name in ("daisy", "dandelion", "roses", "sunflowers", "tulips"):
        (root / name).mkdir(parents=True)
        for path in sorted((ROOT / "data" / "flowers" / name).glob("*.jpg"))[:TINY_FLOWERS]:
            shutil.copy(path, root / name / path.name)
    return root


def test_every_take_home_script_names_the_same_four_files_to_copy():
    """The list a learner follows is in each script's docstring (its --help) and in docs/take-home.md, alike; a
    script that names none imports nothing of the course. The page names the scripts that need the files, and no
    other take-home script, in the section that lists them."""
    expected = ["course/__init__.py", "course/data.py", "course/models.py", "course/train_utils.py"]
    for script in TAKE_HOME:
        text = (SCRIPTS / script).read_text()
        if files_to_copy(script):
            assert files_to_copy(script) == expected, script
        else:
            assert "from course" not in text and "import course" not in text, script
    page = (ROOT / "docs" / "take-home.md").read_text()
    section = page[page.index("## The capstone: copy four course files"):page.index("## Launched the wrong way")]
    assert all(f"`{name}`" in section for name in expected)
    needing = {script for script in TAKE_HOME if files_to_copy(script)}
    assert needing and {s for s in TAKE_HOME if f"`{s}`" in section} == needing, needing
    assert all(f"`{s}`" in page[:page.index("## The capstone")] for s in set(TAKE_HOME) - needing)


@pytest.mark.parametrize("script", list(RUNS))
def test_a_take_home_script_runs_copied_alone(script, datasets, tmp_path):
    root = project(tmp_path, script)
    args, checkpoint = RUNS[script]
    data = tiny_flowers(tmp_path / "flowers") if script == "train_flowers.py" else datasets / "mnist"
    nproc = 1 if script == "train_single.py" else 2  # train_single.py is one process, under torchrun or not
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    result = subprocess.run([*torchrun, script, *args, "--data-dir", str(data), "--run-dir", "runs/mine"],
                            cwd=root, env=environment(), capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])

    # Only the copy's course modules were imported, though the course's own (which has course.hardware,
    # course.runlog, ...) was importable too: Python cached each module it imported from the copy.
    imported = {p.name.split(".")[0] for p in (root / "course" / "__pycache__").glob("*.pyc")}
    assert imported == {"__init__", "data", "models", "train_utils"}, imported

    # What it wrote: relative to the working directory (the project), rank 0 only, nothing in the course folder.
    run_dir = root / "runs" / "mine"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1, "one writer: rank 0"
    assert metrics["script"] == script.removesuffix(".py") and metrics["world_size"] == nproc
    assert (metrics["backend"], metrics["device"]) == ("gloo" if nproc > 1 else None, "cpu")
    assert metrics["steps"] > 0 and metrics["timed_steps"] > 0 and metrics["samples_per_s"] > 0
    assert metrics["train_loss_history"] and 0 <= metrics["val_accuracy"] <= 1
    val_total = 8 if script == "train_flowers.py" else 10000
    total = metrics.get("val_total", sum(map(sum, metrics.get("confusion", []))))
    assert total == val_total, "every validation image counted once"
    assert (root / checkpoint).is_file()
    if checkpoint.endswith(".pt"):
        state = torch.load(root / checkpoint, weights_only=True)
        assert not any(k.startswith("module.") for k in state["model"]), "the unwrapped model is saved"
    assert not list(root.rglob("*.tmp")), "no temporary file left"
    # Nothing of the copy reaches into the course: no run directory or checkpoint of this name there.
    assert not (ROOT / "runs" / "mine").exists()


def test_a_copy_without_course_init_is_refused_not_shadowed(tmp_path):
    """Without course/__init__.py the learner's course/ is a namespace package, which loses to the course
    importable from elsewhere: Python would import the course's data.py, not the learner's. The script stops in
    one line saying which file to create."""
    root = project(tmp_path, "train_flowers.py", init=False)
    result = subprocess.run([sys.executable, "train_flowers.py", "--help"], cwd=root, env=environment(),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and result.stdout == "", result.stdout[-1000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert str(root / "course" / "__init__.py") in result.stderr


@pytest.mark.parametrize("script", ["train_flowers.py"])
def test_outside_the_course_a_missing_data_dir_is_named(script, tmp_path):
    """Copied alone, there is no generated data (and no `make data`): the one error line names --data-dir."""
    root = project(tmp_path, script)
    result = subprocess.run([sys.executable, script], cwd=root, env=environment(), capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: no ") and "--data-dir" in result.stderr
    assert "make data" not in result.stderr and not (root / "weights").exists()


def test_train_ddp_without_torchrun_runs_as_one_process(datasets, tmp_path):
    """`python train_ddp.py` (no torchrun, so no RANK): a job of one process, as nanoGPT's train.py does, not
    KeyError: 'RANK'."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(SCRIPTS / "train_ddp.py", root)
    result = subprocess.run([sys.executable, "train_ddp.py", "--max-steps", "5", "--epochs", "1", "--data-dir",
                             str(datasets / "mnist"), "--run-dir", "runs/python"], cwd=root,
                            env=without_the_course(tmp_path),
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((root / "runs" / "python" / "metrics.json").read_text())
    assert (m["world_size"], m["backend"], m["steps"], m["global_batch"]) == (1, "gloo", 5, 64)
    assert "rank 0 (local rank 0) on cpu" in result.stdout and (root / "weights" / "train_ddp.pt").is_file()


def test_the_copied_course_files_import_nothing_else_of_the_course():
    """course/data.py, models.py and train_utils.py import torch, torchvision, numpy, PIL and the standard library
    only; the take-home scripts import nothing of the course but them."""
    import ast

    for name in ("data.py", "models.py", "train_utils.py"):
        tree = ast.parse((SCRIPTS / "course" / name).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {m for m in modules if m == "course" or m.startswith("course.")}, (name, modules)
    for script in TAKE_HOME:
        if script in PLAIN:
            continue  # test_the_core_scripts_import_torch_torchvision_tensorboard_and_the_standard_library_only
        tree = ast.parse((SCRIPTS / script).read_text())
        course = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module and node.module.startswith("course")}
        assert course <= {"course.data", "course.models", "course.train_utils"}, (script, course)
