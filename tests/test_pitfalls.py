"""Notebooks 04 and 04b. Their headless run (tests/test_notebooks.py) launches every pitfall once and its cells
assert each symptom and fix: devices, set_epoch, the rendezvous pitfalls, uneven inputs, rank-0 writes, the
collective mismatch (DETAIL), GradScaler. Here, read from that same run: the workers job's busy-thread
bookkeeping, the learning-rate job's equal samples, the exercise passing once fixed. Launched here, only what that
run does not show, each test saying why: the set_device refusal, mp.spawn leaving no child, the exercise failing as
committed; and the notebooks' helpers (course.pitfall_jobs, course.spawn_capture). Real torchrun jobs with gloo on
the CPU."""

import contextlib
import os
import re
import sys
import threading
import time

import psutil
import pytest
import torch
from conftest import executed_notebook
from torch.utils.data import DataLoader, TensorDataset

from course import ROOT, SCRIPTS, import_script
from course.checkpoint import load_checkpoint
from course.data import build_datasets
from course.launcher import launch, run_commands
from course.measure import Comparison, Measurement
from course.models import build_model
from course.pitfall_jobs import (
    comparison_from,
    device_reports,
    first_indices,
    join_weight,
    key_lines,
    must_fail,
    reading,
    symptom,
)
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


@pytest.fixture(scope="module")
def notebook_04():
    """Notebook 04's headless run (shared with tests/test_notebooks.py)."""
    return executed_notebook("04_pitfalls").require_ok()


@pytest.fixture(scope="module")
def notebook_04b():
    """Notebook 04b's headless run (shared with tests/test_notebooks.py)."""
    return executed_notebook("04b_pitfalls_reference").require_ok()


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the refusal on a machine without a GPU")
def test_set_device_bug_refuses_to_run_without_a_gpu(no_leftovers):
    """Launches: the notebook runs this bug only where there are GPUs."""
    no_leftovers("pitfall_device.py")
    result = launch("pitfall_device.py", nproc=1, args=["--bug", "set-device"], check=False, timeout=120, **QUIET)
    assert result.returncode != 0 and "needs a GPU" in result.output


def test_workers_comparison_runs_every_configuration_in_one_job(notebook_04):
    """Read from notebook 04's run: every configuration measured in its rounds, and the busy-thread bookkeeping:
    ranks x (threads + loader workers) that want a core at once."""
    metrics = notebook_04.metrics("workers", folder="04_pitfalls")
    speeds = comparison(metrics)
    names = list(speeds.measurements)
    assert len(names) == len(set(names)) >= 2
    rounds = {len(m.values) for m in speeds.measurements.values()}
    assert len(rounds) == 1 and rounds.pop() >= 2
    assert all(min(m.values) > 0 for m in speeds.measurements.values())
    expected = {}
    for name in names:
        workers, threads = map(int, re.fullmatch(r"(\d+) workers?, (\d+) threads? per rank", name).groups())
        expected[name] = 2 * (threads + workers)
    assert metrics["busy"] == expected
    assert speeds.conclusion(names[1], names[0]) in ("above", "below", "same", "unclear", "noisy")


def test_the_workers_loader_starts_its_workers_from_a_process_without_threads():
    """Issue 51: in `make course QUICK=1` notebook 04's workers job hung once (reproduced: 1 of 20 runs of the
    quick job, rank 1 timed out in DDP's forward waiting for rank 0, which never left its round with 2 workers).
    Its loader forked its workers from the rank (the DataLoader's default on Linux), which by then runs gloo's,
    OpenMP's and TensorBoard's threads: a lock one of them holds at the fork stays held in the worker for good.
    The script's loader must not fork its workers from this process (a fork server, or spawn), must start them
    once, and must time out instead of waiting for ever. The old loader fails here (workers started at every
    iter()); with persistent workers but the default start method it fails too (forked from this process)."""
    script = import_script("pitfall_workers")
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)  # this process runs another thread, as a rank does
    other.start()
    loader = script.make_loader(TensorDataset(torch.arange(8.0)), None, workers=2, batch_size=2)
    assert loader.persistent_workers, "the workers must start once per loader, not at every iter()"
    try:
        assert sorted(torch.cat([batch for batch, in loader]).tolist()) == list(range(8))
        workers = [psutil.Process(w.pid) for w in loader._iterator._workers]  # alive: persistent_workers
        for worker in workers:
            parent = psutil.Process(worker.ppid())
            if parent.pid == os.getpid():  # started here: a new program (spawn) is safe, a copy (fork) is not
                assert worker.cmdline() != parent.cmdline(), "the workers were forked from this multi-threaded process"
            else:  # forked by another process (a fork server): one that runs no other thread
                assert parent.num_threads() == 1, f"the workers were forked from a process with {parent.num_threads()} threads"
        assert sorted(torch.cat([batch for batch, in loader]).tolist()) == list(range(8))  # a second epoch
        assert {w.pid for w in loader._iterator._workers} == {w.pid for w in workers}, "the same workers again"
        assert 0 < loader.timeout < 120, "a stuck batch must fail before the job's 120 s process-group timeout"
    finally:
        idle.set()
        if loader._iterator is not None:
            loader._iterator._shutdown_workers()


def test_a_comparison_is_read_from_its_own_numbers():
    """Learner review (issue 52): 04's workers cell showed a median of 0.49x (4 of 5 rounds below 0.55x) and then
    printed "Not shown here: no setting was decided slower". reading() says what the medians suggest and why the
    rounds do not decide; a decided verdict is said as one."""
    base = [300.0, 310.0, 290.0, 305.0, 300.0]
    speeds = Comparison({"1 thread": Measurement("1 thread", base),
                         "2 threads": Measurement("2 threads", [147.0, 148.0, 290.0, 155.0, 140.0]),
                         "steady": Measurement("steady", [99.0, 102.0, 98.0, 101.0, 100.0]),
                         "same": Measurement("same", [302.0, 305.0, 291.0, 300.0, 303.0])}, "samples/s")
    assert sum(r < 0.55 for r in speeds.ratios("2 threads", "1 thread")) == 4
    noisy = reading(speeds, "2 threads", "1 thread")
    assert noisy.startswith("Not decided here: '2 threads' at 0.49x the samples/s of '1 thread' (median of the "
                            "rounds) suggests slower, but its rounds do not agree")
    assert reading(speeds, "steady", "1 thread").startswith("Shown here: 'steady' at 0.33x") and \
        reading(speeds, "steady", "1 thread").endswith(": slower in every one of 5 rounds.")
    assert reading(speeds, "same", "1 thread").endswith(": about the same in every one of 5 rounds.")
    accuracy = Comparison({"without": Measurement("without", [0.934]), "with": Measurement("with", [0.925])},
                          "val accuracy")
    assert reading(accuracy, "with", "without") == (
        "Not decided here: 'with' at 0.99x the val accuracy of 'without' (median of the rounds) suggests about the "
        "same, but 1 round cannot decide (a verdict needs 5 that agree).")
    seconds = Comparison({"a": Measurement("a", [1.0] * 5), "b": Measurement("b", [2.0] * 5)}, "s",
                         higher_is_better=False)
    assert reading(seconds, "b", "a").endswith(": slower in every one of 5 rounds.")


def test_set_epoch_orders_are_compared_with_the_first_epoch():
    compared = import_script("pitfall_set_epoch").compared_with_first
    assert compared([[3, 1, 2, 0], [3, 1, 2, 0], [3, 1, 2, 0]]) == {
        "same_order": [True, True], "new_samples": [0.0, 0.0], "per_epoch": 4}
    assert compared([[3, 1, 2, 0], [1, 3, 5, 7]]) == {"same_order": [False], "new_samples": [0.5], "per_epoch": 4}


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


def test_learning_rate_runs_compare_three_configurations_at_equal_samples(notebook_04b):
    """Read from notebook 04b's run (12 800 samples in quick mode): the step counts of equal samples, exactly."""
    metrics = notebook_04b.metrics("lr", folder="04_pitfalls")
    accuracies = comparison(metrics)
    small, kept, scaled = metrics["names"]
    assert (small, kept, scaled) == ("global batch 64, lr 0.01", "global batch 128, lr 0.01 (kept)",
                                     "global batch 128, lr 0.02 (scaled x2)")
    assert metrics["steps"] == {small: 200, kept: 100, scaled: 100}  # equal samples: 12 800
    assert all(0 < value <= 1 for m in accuracies.measurements.values() for value in m.values)


def exercise_passes(metrics, checkpoint) -> bool:
    """Notebook 04b's check: the reported accuracy is the saved model's accuracy on the whole validation set."""
    _, val_set, num_classes = build_datasets("mnist")
    model = build_model("mlp", num_classes)
    model.load_state_dict(load_checkpoint(checkpoint)["model"])
    model.eval()
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in DataLoader(val_set, 1000))
    return metrics["val_total"] == len(val_set) and metrics["val_correct"] == correct


def test_check_yourself_exercise_fails_as_committed_and_passes_once_fixed(no_leftovers, tmp_path, notebook_04b):
    """Launches the exercise as committed (the notebook's headless run answers from the key, so it runs only the
    fixed script, whose run and checkpoint are read here)."""
    no_leftovers("pitfall_exercise.py")
    checkpoint = tmp_path / "pitfall_exercise.pt"
    result = launch("pitfall_exercise.py", nproc=2, args=["--checkpoint", checkpoint], run_dir=tmp_path / "run",
                    timeout=300, **QUIET)
    assert exercise_passes(result.metrics, checkpoint) is False, "the exercise as committed must fail the check"
    fixed = notebook_04b.metrics("exercise", folder="04_pitfalls")
    assert exercise_passes(fixed, notebook_04b.written(ROOT / "weights" / "04_pitfalls_exercise.pt")) is True
    assert "PASS: the reported accuracy is the model's accuracy on the whole validation set." in notebook_04b.output()


def test_symptom_keeps_each_line_once_and_drops_the_copies_torchrun_repeats(capsys):
    output = "[rank0]: boom here\n[rank1]: boom here\nboom here\n[rank0]: boom here\nnothing\n" + "x boom\n" * 12
    found = symptom(output, "boom", limit=3)
    assert found[:2] == ["[rank0]: boom here", "[rank1]: boom here"]  # the untagged repeat and the duplicate: gone
    assert "boom here" not in found and len(found) == 3  # "x boom" once
    printed = capsys.readouterr().out
    assert printed.startswith("SYMPTOM:") and "nothing" not in printed


def test_lines_of_a_run_that_works_are_not_labelled_symptom(capsys):
    """Learner review: the success lines of a fixed run were printed under "SYMPTOM:"."""
    assert key_lines("[rank0]:rank 0: done\n", "done") == ["[rank0]:rank 0: done"]
    assert capsys.readouterr().out.startswith("RESULT:")


def test_the_readers_of_the_pitfall_scripts_lines():
    """What the notebooks' cells used to parse with regular expressions, read by course.pitfall_jobs."""
    output = ("[rank1]:rank 1 (local rank 1, gloo): parameters on cpu, current GPU index n/a (CPU)\n"
              "[rank0]:rank 0 (local rank 0, nccl): parameters on cuda:0, current GPU index 0\n"
              "[rank0]:[without set_epoch, seed 0] rank 0 epoch 0: first indices [3, 1]\n"
              "[rank0]:[with set_epoch, seed 0] rank 0 epoch 0: first indices [3, 1]\n"
              "[rank0]:[with set_epoch, seed 1] rank 0 epoch 0: first indices [9, 9]\n"
              "[rank0]:[with set_epoch, seed 0] rank 0 epoch 1: first indices [2, 0]\n"
              "[rank0]:rank 0 step 5: the others have joined; DDP applied 0.25 x this batch's own gradient\n")
    assert device_reports(output) == [(0, "nccl", "cuda:0", "0"), (1, "gloo", "cpu", "n/a (CPU)")]
    assert first_indices(output) == {"without": ["[3, 1]"], "with": ["[3, 1]", "[2, 0]"]}
    assert join_weight(output) == 0.25


def test_notebook_04_says_what_each_measurement_showed(notebook_04):
    """Learner review: pitfall 4's symptom and pitfall 2's fix were stated, not shown. The cells print what this
    run measured; fixed runs are not labelled as symptoms; Check yourself asks about runs no cell made."""
    text = notebook_04.output()
    speeds = comparison(notebook_04.metrics("workers", folder="04_pitfalls"))
    names = list(speeds.measurements)
    for name in names[1:]:  # each setting's sentence, computed from the run's own numbers
        assert reading(speeds, name, names[0]) in text
    assert "no setting was decided slower" not in text
    accuracy = comparison(notebook_04.metrics("set_epoch", folder="04_pitfalls"))
    assert reading(accuracy, "with set_epoch", "without set_epoch") in text
    assert re.search(r"^Shown here: without set_epoch, rank 0 trained on the same samples in the same order every "
                     r"epoch; with it, every epoch brought a new order and samples new to rank 0\.$", text,
                     re.MULTILINE)
    assert not re.search(r"SYMPTOM:\n  \[rank\d\]:rank \d: 3 steps done", text)  # pitfall 3's fixed run
    assert "on 4 ranks Join weighted the extra batch 0.25x" in text


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
