"""Notebooks 04 and 04b. Their headless run (tests/test_notebooks.py) launches every pitfall once and its cells
assert each symptom and fix: devices, set_epoch, the rendezvous pitfalls, uneven inputs, rank-0 writes, the
collective mismatch (DETAIL), GradScaler. Here only what that run does not show, each test saying why it launches:
the set_device refusal, the workers job's busy-thread bookkeeping, mp.spawn leaving no child, the learning-rate
job's equal samples, the exercise passing once fixed; and the notebooks' helpers (course.pitfall_jobs,
course.spawn_capture). Real torchrun jobs with gloo on the CPU."""

import contextlib
import re
import sys
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from course import ROOT, SCRIPTS
from course.checkpoint import load_checkpoint
from course.data import build_datasets
from course.launcher import launch, run_commands
from course.measure import Comparison
from course.models import build_model
from course.pitfall_jobs import comparison_from, must_fail, symptom
from course.spawn_capture import output_of_children, spawn_bounded

QUIET = {"backend": "gloo", "quiet": True, "on_line": lambda _: None}  # CPU, even on a GPU box
CPU_ONLY = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def no_leftovers(wait_no_processes):
    """Yields a function that registers a script; after the test, none of its processes may remain."""
    watched = []
    yield lambda script: watched.append(str(SCRIPTS / script))  # full path: not another checkout's jobs
    for script in watched:
        assert wait_no_processes(script, timeout=10) == [], f"processes of {script} left behind"


def comparison(metrics) -> Comparison:
    return comparison_from(metrics["comparison"])


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the refusal on a machine without a GPU")
def test_set_device_bug_refuses_to_run_without_a_gpu(no_leftovers):
    """Launches: the notebook runs this bug only where there are GPUs."""
    no_leftovers("pitfall_device.py")
    result = launch("pitfall_device.py", nproc=1, args=["--bug", "set-device"], check=False, timeout=120, **QUIET)
    assert result.returncode != 0 and "needs a GPU" in result.output


def test_workers_comparison_runs_every_configuration_in_one_job(no_leftovers, tmp_path):
    """Launches: a 2-configuration job small enough to check the busy-thread bookkeeping exactly."""
    no_leftovers("pitfall_workers.py")
    result = launch("pitfall_workers.py", nproc=2, args=["--configs", "0:1", "1:1", "--rounds", 2, "--steps", 2,
                                                          "--warmup", 1, "--batch-size", 8],
                    run_dir=tmp_path, timeout=300, **QUIET)
    speeds = comparison(result.metrics)
    assert list(speeds.measurements) == ["0 workers, 1 thread per rank", "1 worker, 1 thread per rank"]
    assert all(len(m.values) == 2 and min(m.values) > 0 for m in speeds.measurements.values())
    assert result.metrics["busy"] == {"0 workers, 1 thread per rank": 2, "1 worker, 1 thread per rank": 4}
    assert speeds.conclusion("1 worker, 1 thread per rank", "0 workers, 1 thread per rank") in \
        ("above", "below", "same", "unclear", "noisy")




def spawned_children() -> list[psutil.Process]:
    """Processes started by multiprocessing's spawn from this checkout (their command line names no script)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(proc.info["cmdline"] or []) and proc.info["cwd"] == str(ROOT):
                found.append(proc)
    return found


def test_mp_spawn_of_a_function_without_a_module_fails_and_from_a_file_works(no_leftovers):
    """Launches: checks that no spawned child outlives the job, which the notebook does not look for."""
    no_leftovers("pitfall_spawn.py")
    in_main = ("import torch.multiprocessing as mp\n"
               "def worker(rank):\n    print('worker', rank)\n"
               "mp.spawn(worker, nprocs=2)\n")  # like a notebook: __main__ has no file to re-import
    bad = run_commands([("", [sys.executable, "-c", in_main], CPU_ONLY)], timeout=120, on_line=lambda _: None)
    assert bad.returncode != 0
    assert "Can't get attribute 'worker' on <module '__main__'" in bad.output
    good = run_commands([("", [sys.executable, str(SCRIPTS / "pitfall_spawn.py")], CPU_ONLY)], timeout=120,
                        on_line=lambda _: None)
    assert good.returncode == 0 and good.output.count("all_reduce sum 3") == 2
    deadline = time.monotonic() + 10
    while spawned_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert spawned_children() == []


def test_learning_rate_runs_compare_three_configurations_at_equal_samples(no_leftovers, tmp_path):
    """Launches: one small round, to check the step counts of equal samples exactly."""
    no_leftovers("pitfall_lr.py")
    result = launch("pitfall_lr.py", nproc=2, args=["--samples", 1280, "--rounds", 1], run_dir=tmp_path,
                    timeout=300, **QUIET)
    accuracies = comparison(result.metrics)
    small, kept, scaled = result.metrics["names"]
    assert (small, kept, scaled) == ("global batch 64, lr 0.01", "global batch 128, lr 0.01 (kept)",
                                     "global batch 128, lr 0.02 (scaled x2)")
    assert result.metrics["steps"] == {small: 20, kept: 10, scaled: 10}  # equal samples: 1280
    assert all(0 < m.values[0] <= 1 for m in accuracies.measurements.values())


def exercise_passes(result, checkpoint) -> bool:
    """Notebook 04's check: the reported accuracy is the saved model's accuracy on the whole validation set."""
    _, val_set, num_classes = build_datasets("mnist")
    model = build_model("mlp", num_classes)
    model.load_state_dict(load_checkpoint(checkpoint)["model"])
    model.eval()
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in DataLoader(val_set, 1000))
    return result.metrics["val_total"] == len(val_set) and result.metrics["val_correct"] == correct


def test_check_yourself_exercise_fails_as_committed_and_passes_once_fixed(no_leftovers, tmp_path):
    """Launches: the notebook runs only the exercise as committed; the fixed one proves the check can pass."""
    no_leftovers("pitfall_exercise.py")
    buggy = SCRIPTS / "pitfall_exercise.py"
    fixed = tmp_path / "pitfall_exercise_fixed.py"
    counts_line = "    correct, total = counts.tolist()\n"
    assert buggy.read_text().count(counts_line) == 1
    fixed.write_text(buggy.read_text().replace(counts_line, "    dist.all_reduce(counts)\n" + counts_line))
    for script, passes in ((buggy, False), (fixed, True)):
        checkpoint = tmp_path / f"{script.stem}.pt"
        result = launch(script, nproc=2, args=["--checkpoint", checkpoint], run_dir=tmp_path / script.stem,
                        timeout=300, **QUIET)
        assert exercise_passes(result, checkpoint) is passes, script.name


def test_symptom_keeps_each_line_once_and_drops_the_copies_torchrun_repeats(capsys):
    output = "[rank0]: boom here\n[rank1]: boom here\nboom here\n[rank0]: boom here\nnothing\n" + "x boom\n" * 12
    found = symptom(output, "boom", limit=3)
    assert found[:2] == ["[rank0]: boom here", "[rank1]: boom here"]  # the untagged repeat and the duplicate: gone
    assert "boom here" not in found and len(found) == 3  # "x boom" once
    printed = capsys.readouterr().out
    assert printed.startswith("SYMPTOM:") and "nothing" not in printed


def test_must_fail_refuses_a_job_that_succeeds(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    with pytest.raises(AssertionError, match="was expected to fail"):
        must_fail("pitfall_rendezvous.py", nproc=1, backend="gloo")


def _print_rank(rank):
    print(f"child {rank} says hello", flush=True)


def _sleep_forever(rank):
    time.sleep(600)


def test_spawn_capture_catches_the_childrens_output_and_ends_them_in_time():
    with output_of_children() as children:
        codes = spawn_bounded(_print_rank, nprocs=2, timeout=60)
    assert codes == [0, 0]
    assert children[0].count("says hello") == 2
    started = time.monotonic()
    with pytest.raises(TimeoutError), output_of_children():
        spawn_bounded(_sleep_forever, nprocs=1, timeout=3)
    assert time.monotonic() - started < 60
    assert spawned_children() == []


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("pitfall_*.py")))
def test_each_pitfall_script_names_the_notebook_that_writes_it(script):
    first = (SCRIPTS / script).read_text().splitlines()[0]
    notebook = re.search(r"notebooks/(\S+\.ipynb)", first)[1]
    assert f"%%writefile ../scripts/{script}" in (ROOT / "notebooks" / notebook).read_text().replace("\\n", "\n")
