"""Issue 35 #1 and #2: every script of notebooks 10-12 answers bad input with one ``error:`` line naming the flag,
the value and the rule, before any process group, once per job; a DCP checkpoint that is missing, empty or
corrupt gets one line saying which and what, never the advice to unpickle it with weights_only=False.

Most cases run in this process: each script's ``main()`` with a made-up torchrun environment, and the process
group's start replaced by a failure (reaching it means a check came too late). A few go through a real
``python`` and a real torchrun job of 2 gloo processes (the line once per job, no traceback, exit status 2).
"""

import os
import pickle
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import executed_notebook
from torch.distributed import device_mesh

from course import ROOT, RUNS, SCRIPTS, import_script
from course.dcp_check import MANIFEST, load_failure, problem
from course.launcher import launch


def _dcp_folder(path):
    """A small DCP checkpoint (one process, no process group): two tensors and a number."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.randn(3, 4), "b": torch.randn(4)}, "step": 3}, checkpoint_id=str(path))
    return path


def _corrupt(kind):
    """A way to damage a DCP folder, and the words the one line must hold."""
    def first_piece(path):
        info = min(dcp.FileSystemReader(str(path)).read_metadata().storage_data.values(), key=lambda i: i.offset)
        return path / info.relative_path, info

    def truncate(path):
        file, info = first_piece(path)
        file.write_bytes(file.read_bytes()[:info.offset + info.length // 2])

    def zero(path):
        file, info = first_piece(path)
        data = bytearray(file.read_bytes())
        data[info.offset:info.offset + info.length] = bytes(info.length)
        file.write_bytes(bytes(data))

    def zero_metadata(path):
        meta = path / ".metadata"
        meta.write_bytes(bytes(meta.stat().st_size))

    def code_metadata(path):
        (path / ".metadata").write_bytes(pickle.dumps(os.getpid))  # any global outside DCP's classes

    def no_shard(path):
        first_piece(path)[0].unlink()

    return {"truncated shard": (truncate, "truncated"), "zeroed shard": (zero, "corrupt"),
            "zeroed .metadata": (zero_metadata, ".metadata is corrupt"),
            "code in .metadata": (code_metadata, "run code"), "missing shard": (no_shard, "missing"),
            "no .metadata": (lambda p: (p / ".metadata").unlink(), "no .metadata")}[kind]


# (script, world size, arguments, what the one error line must name besides the value)
CASES = [
    ("train_lm", 1, ["--steps", "0"], "--steps"),
    ("train_lm", 1, ["--steps", "-5"], "--steps"),
    ("train_lm", 1, ["--steps", "x"], "--steps"),
    ("train_lm", 1, ["--n-layer", "0"], "--n-layer"),
    ("train_lm", 1, ["--n-head", "3"], "--n-head"),
    ("train_lm", 1, ["--batch-size", "0"], "--batch-size"),
    ("train_lm", 1, ["--batch-size", "20000"], "--batch-size"),
    ("train_lm", 1, ["--lr", "0"], "--lr"),
    ("train_lm", 1, ["--log-every", "0"], "--log-every"),
    ("train_lm", 1, ["--block-size", "0"], "--block-size"),
    ("train_lm", 1, ["--data-dir", "/nowhere/texts"], "--data-dir"),
    ("train_lm", 1, ["--data-dir", "{empty}"], "--data-dir"),
    ("train_lm", 1, ["--save", "{empty}"], "--save"),
    ("train_tp", 3, [], "--n-head"),
    ("train_tp", 2, ["--n-head", "3", "--n-embd", "48"], "--n-head"),
    ("train_tp", 3, ["--n-head", "6", "--n-embd", "48", "--sequence-parallel"], "--sequence-parallel"),
    ("train_tp", 2, ["--steps", "0"], "--steps"),
    ("train_tp", None, [], "torchrun"),
    ("train_pp", 2, ["--microbatches", "3"], "--microbatches"),
    ("train_pp", 2, ["--microbatches", "0"], "--microbatches"),
    ("train_pp", 2, ["--schedule", "1f1b", "--microbatches", "1"], "--microbatches"),
    ("train_pp", 2, ["--schedule", "interleaved1f1b"], "--n-layer"),
    ("train_pp", 2, ["--schedule", "zerobubble", "--n-layer", "4", "--microbatches", "5", "--batch-size", "60"],
     "--microbatches"),
    ("train_pp", 2, ["--schedule", "2f2b"], "--schedule"),
    ("train_pp", 4, [], "--n-layer"),
    ("train_2d", 4, ["--dp", "3"], "--dp"),
    ("train_2d", 4, ["--dp", "0"], "--dp"),
    ("train_2d", 4, ["--dp", "1", "--n-head", "2"], "--n-head"),
    ("train_2d", 4, ["--batch-size", "63"], "--batch-size"),
    ("train_2d", 4, ["--layout", "hsdp", "--sequence-parallel"], "--sequence-parallel"),
    ("train_2d", 4, ["--layout", "hsdp", "--batch-size", "30"], "--batch-size"),
    ("train_2d", 6, ["--n-head", "6", "--n-embd", "48", "--sequence-parallel"], "--sequence-parallel"),
    ("tp_by_hand", 2, ["--width", "0"], "--width"),
    ("tp_by_hand", 3, ["--width", "2"], "--width"),
    ("tp_by_hand", 2, ["--tokens", "-1"], "--tokens"),
    ("tp_costs", 2, ["--n-embd", "30"], "--n-embd"),
    ("tp_costs", 3, [], "--nproc-per-node"),
    ("tp_costs", 2, ["--n-layer", "0"], "--n-layer"),
    ("tp_costs", 3, ["--sequence-parallel"], "--nproc-per-node"),
    ("dtensor_basics", 2, ["--steps", "3"], "--steps"),
    ("pp_by_hand", 3, [], "--nproc-per-node"),
    ("pp_by_hand", 2, ["--microbatches", "5"], "--microbatches"),
    ("pp_by_hand", 2, ["--steps", "0"], "--steps"),
    ("pp_by_hand", 2, ["--n-layer", "1"], "--n-layer"),
    ("pp_schedules", 2, ["--microbatches", "3", "4"], "--microbatches"),
    ("pp_schedules", 2, ["--rounds", "0"], "--rounds"),
    ("pp_schedules", 2, ["--n-layer", "2"], "--n-layer"),
    ("pp_schedules", 2, ["--microbatches", "5", "--batch-size", "60"], "--microbatches"),
    ("pp_schedules", 2, ["--n-embd", "30"], "--n-embd"),
    ("moe_layer", 4, ["--tokens", "0"], "--tokens"),
    ("moe_layer", 4, ["--width", "-3"], "--width"),
    ("moe_layer", None, [], "torchrun"),
    ("mesh_basics", 4, ["--dp", "3"], "--dp"),
    ("mesh_basics", 4, ["--dp", "0"], "--dp"),
    ("hsdp_bytes", 4, ["--dp", "3"], "--dp"),
    ("hsdp_bytes", 4, ["--batch-size", "30"], "--batch-size"),
    ("dcp_reshape", 4, [], "--save"),
    ("dcp_reshape", 4, ["--save", "a", "--load", "b"], "--save"),
    ("dcp_reshape", 4, ["--save", "{ckpt}", "--dp", "3"], "--dp"),
    ("dcp_reshape", 8, ["--save", "{ckpt}", "--dp", "1"], "--dp"),
    ("dcp_reshape", 4, ["--save", "{ckpt}", "--steps", "0"], "--steps"),
    ("dcp_reshape", 4, ["--save", "{ckpt}", "--batch-size", "63"], "--batch-size"),
    ("dcp_reshape", 4, ["--save", "{file}"], "--save"),
    ("dcp_reshape", 1, ["--load", "/nowhere/ckpt", "--dp", "1"], "--load"),
    ("dcp_reshape", 1, ["--load", "{empty}", "--dp", "1"], "--load"),
    ("dcp_reshape", 1, ["--load", "{file}", "--dp", "1"], "--load"),
    ("pitfall_pp_hang", 3, [], "--nproc-per-node"),
    ("pitfall_pp_hang", 2, ["--timeout", "0"], "--timeout"),
    ("pitfall_pp_hang", 2, ["--microbatches", "0"], "--microbatches"),
    ("pitfall_pp_shapes", 2, ["--batch-size", "0"], "--batch-size"),
    ("pitfall_pp_shapes", 1, [], "--nproc-per-node"),
]


@pytest.fixture
def no_process_group(monkeypatch):
    """Starting a process group (or a mesh, which starts one) fails the case: the check came too late."""
    def started(*args, **kwargs):
        raise AssertionError("the process group started before the input was checked")
    for module, name in [(dist, "init_process_group"), (dist.distributed_c10d, "init_process_group"),
                         (device_mesh, "init_device_mesh"), (device_mesh, "init_process_group")]:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, started)
    return started


def run_main(script, world, argv, monkeypatch, capsys):
    """``script``'s main() as rank 0 of a job of ``world`` processes (None: not under torchrun); returns
    (exit status, stderr)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if world is not None:
        for name, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}.items():
            monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    module = import_script(script)
    capsys.readouterr()
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert time.monotonic() - start < 20, "the check took too long"
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("script, world, argv, flag", CASES, ids=[f"{c[0]}-{c[1]}-{' '.join(c[2])}" for c in CASES])
def test_bad_input_gets_one_line_naming_the_flag_before_any_process_group(
        script, world, argv, flag, tmp_path, monkeypatch, capsys, no_process_group):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a checkpoint\n")
    places = {"{empty}": str(tmp_path / "empty"), "{ckpt}": str(tmp_path / "ckpt"), "{file}": str(tmp_path / "file")}
    argv = [places.get(a, a) for a in argv]
    code, err = run_main(script, world, argv, monkeypatch, capsys)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1, err
    assert flag in lines[0], lines[0]
    given = argv.index(flag) + 1 if flag in argv else len(argv)
    value = argv[given] if given < len(argv) and not argv[given].startswith("--") else None
    assert value is None or value in lines[0], lines[0]  # and the value given to it, where there is one
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["truncated shard", "zeroed shard", "zeroed .metadata", "code in .metadata",
                                  "missing shard", "no .metadata"])
def test_a_damaged_dcp_checkpoint_is_named_in_one_line(kind, tmp_path, monkeypatch, capsys, no_process_group):
    folder = _dcp_folder(tmp_path / "ckpt")
    assert problem(folder) is None  # whole, before the damage
    damage, words = _corrupt(kind)
    damage(folder)
    why = problem(folder)
    assert why is not None and str(folder) in why and words in why, why
    code, err = run_main("dcp_reshape", 1, ["--load", str(folder), "--dp", "1"], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and why in lines[0], err
    assert "weights_only" not in err and "Traceback" not in err


def test_code_in_metadata_is_refused_without_running_it(tmp_path, monkeypatch):
    folder = _dcp_folder(tmp_path / "ckpt")
    ran = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Marker(str(ran))))
    assert "run code" in problem(folder) and not ran.exists()


class _Marker:
    """Unpickling it would write a file: the proof that nothing was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_load_failure_inside_dcp_becomes_one_line_without_the_pickle_advice():
    inner = pickle.UnpicklingError("Weights only load failed. ... you can use weights_only=False ...")
    failure = dcp.CheckpointException("load", {1: (inner, None)})
    line = load_failure("runs/x", failure)
    assert line.startswith("checkpoint runs/x could not be loaded (rank 1)") and "corrupt" in line
    assert "weights_only" not in line and "\n" not in line
    line = load_failure("runs/x", dcp.CheckpointException("load", {0: (RuntimeError("Size mismatch\nmore"), None)}))
    assert line.endswith("RuntimeError: Size mismatch")


# --------------------------------------------------------------------- a real python, a real torchrun job


def test_a_real_process_prints_usage_and_one_line_and_exits_2():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(SCRIPTS)
    done = subprocess.run([sys.executable, str(SCRIPTS / "train_lm.py"), "--n-layer", "0"], check=False,
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == "train_lm.py: error: argument --n-layer: 0 must be > 0", done.stderr
    assert done.stderr.startswith("usage: train_lm.py") and "Traceback" not in done.stderr


@pytest.mark.parametrize("script, argv, flag", [
    ("train_tp.py", ["--n-head", "3", "--n-embd", "48"], "--n-head"),  # a rule between a flag and the world
    ("train_pp.py", ["--steps", "0"], "--steps"),  # a bad value, caught by argparse on every rank
])
def test_once_per_job_under_torchrun(script, argv, flag):
    result = launch(script, nproc=2, args=argv, timeout=120, check=False, on_line=lambda _: None)  # bounded
    lines = [line for line in result.output.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(lines) == 1 and flag in lines[0], result.output
    assert lines[0].startswith("[rank0]:"), lines[0]
    assert not [line for line in result.output.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert "rank 0 exited with code 2" in result.failure, result.failure  # rank 1 exited quietly, after it


def test_corruption_deep_inside_a_piece_is_refused_by_the_manifest_or_one_line_from_dcp_load(tmp_path):
    """Notebook 12's own checkpoint carries dcp_reshape.py's sha256.json; a copy damaged where the cheap check
    cannot see (the zip's end record, its first bytes right) is refused by it before any process starts. Without
    the manifest (a folder written elsewhere) it loads with a "not verified" note and fails inside dcp.load: still
    one line, from rank 0, naming the checkpoint."""
    notebook = executed_notebook("12_composed_parallelism")
    source = notebook.written(RUNS / "12_composed_parallelism" / "checkpoint" / ".metadata").parent
    assert (source / MANIFEST).is_file() and problem(source) is None
    folder = shutil.copytree(source, tmp_path / "ckpt")
    info = max(dcp.FileSystemReader(str(folder)).read_metadata().storage_data.values(), key=lambda i: i.length)
    file = folder / info.relative_path
    data = bytearray(file.read_bytes())
    end = info.offset + info.length
    data[end - 22:end] = bytes(22)  # the zip's end record: torch.load can no longer find its directory
    file.write_bytes(bytes(data))
    assert f"{info.relative_path} does not match its sha256" in problem(folder)
    (folder / MANIFEST).unlink()
    assert problem(folder) is None  # the cheap check alone passes it
    result = launch("dcp_reshape.py", nproc=1, args=["--load", folder, "--dp", "1"], timeout=120, check=False,
                    on_line=lambda _: None)
    lines = [line for line in result.output.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(lines) == 1, result.output
    assert f"checkpoint {folder} could not be loaded" in lines[0] and "weights_only" not in result.output
    assert f"checkpoint {folder} has no {MANIFEST}" in result.output
