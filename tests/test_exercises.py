"""Notebook 09's exercise checker: every stub is reported unsolved with its hint, every classic mistake (a
mutated reference solution) fails with *its* diagnosis, a crash and a hang are reported as such within their
timeouts, and the notebook runs headless with the solutions filled in, every check passing.

Real torchrun jobs with gloo on the CPU, one per launched check (about 10-20 s each on an idle 2-core box).
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import wait_for_no_processes

from course import ROOT, SCRIPTS
from course.exercises import EXERCISES, SOLUTIONS, _ex1_reference, _ex2_reference, check, hint, progress_rows


@pytest.fixture
def run_check(tmp_path):
    """check() on a script text (or a committed file), writing into tmp_path; no process may be left behind."""
    results = tmp_path / "results.json"

    def run(key, text=None, path=None):
        if text is not None:
            path = tmp_path / f"mutant_{key}" / EXERCISES[key].script
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        start = time.monotonic()
        work = tmp_path / f"work_{key}"
        result = check(key, path, work_dir=work, results_file=results, show=False)
        result.wall = time.monotonic() - start
        assert wait_for_no_processes(str(work), timeout=10) == [], f"processes of the check of {path} left behind"
        return result

    run.results = results
    return run


def mutate(key: str, *replacements: tuple[str, str]) -> str:
    """The reference solution of an exercise with each (old, new) replaced; every old text must be there."""
    text = (SOLUTIONS / EXERCISES[key].script).read_text()
    for old, new in replacements:
        assert old in text, f"the solution of exercise {key} no longer contains {old!r}"
        text = text.replace(old, new)
    return text


# ---------------------------------------------------------------------------------------------------------
# Without launching anything: stubs, syntax errors, the in-process sampler exercise, hints, progress


@pytest.mark.parametrize("key", ["1", "2", "3", "4", "5"])
def test_committed_stub_is_not_solved_yet(key, run_check):
    result = run_check(key, path=SCRIPTS / EXERCISES[key].script)
    assert (result.status, result.diagnosis) == ("not solved", "gaps")
    assert "still marked `...  # TODO`" in result.symptom and "line" in result.symptom
    assert "Replace each `...`" in result.hint
    assert result.seconds < 5, "a stub must be reported without running anything (a launch takes longer)"


def test_syntax_error_is_reported_with_its_line(run_check):
    text = mutate("2", ("def average_gradients(model, world_size):", "def average_gradients(model, world_size)"))
    line = text.splitlines().index("def average_gradients(model, world_size)") + 1
    result = run_check("2", text)
    assert (result.status, result.diagnosis) == ("error", "syntax")
    assert f"SyntaxError in ex2_by_hand.py, line {line}" in result.symptom


def test_sampler_solution_passes(run_check):
    result = run_check("3", path=SOLUTIONS / "ex3_sampler.py")
    assert result.passed, result.symptom
    assert "160 cases" in result.symptom


SAMPLER_MISTAKES = {
    "overlap": [("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed + self.epoch + self.rank)")],
    "same-every-epoch": [("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)")],
    "not-repeatable": [("torch.randperm(self.n, generator=g)", "torch.randperm(self.n)")],
    "count": [("        while len(indices) < total:\n            indices += indices[:total - len(indices)]\n", "")],
    "length": [("self.n // num_replicas if drop_last else math.ceil(self.n / num_replicas)",
                "math.ceil(self.n / num_replicas)")],
    "indices": [("return iter(indices[self.rank::self.num_replicas])",
                 "return iter(indices[self.rank * self.num_samples:(self.rank + 1) * self.num_samples])")],
    "crash": [("indices = list(range(self.n))", "indices = list(range(self.size))")],
}


@pytest.mark.parametrize("diagnosis", SAMPLER_MISTAKES)
def test_sampler_mistake_gets_its_hint(diagnosis, run_check):
    result = run_check("3", mutate("3", *SAMPLER_MISTAKES[diagnosis]))
    assert result.diagnosis == diagnosis, result.symptom
    assert not result.passed
    if diagnosis == "crash":
        assert "AttributeError" in result.symptom and "line" in result.symptom


def test_sampler_that_never_returns_is_interrupted(run_check):
    text = mutate("3", ("        return iter(indices[self.rank::self.num_replicas])",
                        "        while True:\n            pass"))
    result = run_check("3", text)
    assert (result.status, result.diagnosis) == ("error", "hang") and "did not return within" in result.symptom
    assert result.seconds < 20


def test_hints_escalate_and_never_start_with_the_answer(run_check):
    text = mutate("3", *SAMPLER_MISTAKES["same-every-epoch"])
    levels = [run_check("3", text).hint_level for _ in range(2)]
    assert levels == [1, 2]
    shown = hint("3", results_file=run_check.results)
    assert "Hint 3/3" in shown and "solution('3')" in shown
    first = EXERCISES["3"].hints_for("same-every-epoch")[0]
    assert "self.epoch" not in first, "the first hint must describe the symptom, not the fix"
    rows = {r["exercise"]: r for r in progress_rows(run_check.results)}
    assert rows["3"]["status"] == "fail" and rows["3"]["checks"] == 2 and rows["1"]["status"] == "not tried"


def test_every_diagnosis_a_check_can_make_has_hints():
    import re

    from course.exercises import COMMON_HINTS

    source = (SOLUTIONS.parent / "exercises.py").read_text()
    made = set(re.findall(r'_fail\(\s*"([a-z0-9-]+)"', source)) | set(re.findall(r'diagnosis = "([a-z0-9-]+)"', source))
    made |= {"hang", "crash", "syntax", "gaps", "missing"}
    with_hints = set(COMMON_HINTS).union(*(ex.hints for ex in EXERCISES.values()))
    assert made - with_hints == set()
    for ex in EXERCISES.values():
        for hints in ex.hints.values():
            assert hints and all(isinstance(h, str) and h for h in hints)


def test_single_device_script_is_the_reference(tmp_path):
    """Exercise 1's reference (computed in-process by the checker) is what ex1_single.py computes."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPTS / "ex1_single.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True, env=env, timeout=120)
    ref = _ex1_reference()
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log if "loss" in r] == pytest.approx(ref.losses, abs=1e-5)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    for (name, value), expected in zip(state.items(), ref.params[-1], strict=True):
        torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-4, msg=name)
    assert (log[-1]["val_correct"], log[-1]["val_total"]) == ref.val


def test_two_simulated_ranks_equal_the_single_process_reference():
    """What every check relies on: 2 ranks x B/2 with averaged gradients = 1 process x B, to float rounding."""
    one, two = _ex2_reference(), _ex2_reference(2)
    for a, b in zip(one.params[-1], two.params[-1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Launched on 2 processes: each classic mistake fails with its own diagnosis

LAUNCHED_MISTAKES = {
    ("1", "every-rank-writes"): [("    if rank == 0:  # DDP step 5: one process writes", "    if True:  # every rank")],
    ("1", "local-loss"): [('"loss": global_loss.item() / world_size}', '"loss": loss.item()}')],
    ("1", "val-padded"): [("DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 100)",
                           "DataLoader(val_set, 100, sampler=DistributedSampler(val_set, shuffle=False))")],
    ("2", "summed"): [("        p.grad /= world_size\n", "")],
    ("2", "no-broadcast"): [("        dist.broadcast(p.data, src=0)", "        pass")],
    ("2", "hang"): [("        dist.all_reduce(p.grad)  # the sum",
                     "        if dist.get_rank() == 0:\n            dist.all_reduce(p.grad)  # the sum")],
    ("2", "crash"): [("        p.grad /= world_size\n", "        p.grad /= world_sise\n")],
    ("4", "per-parameter"): [("self.buckets = make_buckets(model.parameters(), cap)",
                              "self.buckets = [[p] for p in reversed(list(model.parameters()))]")],
    ("5", "state-not-sharded"): [("torch.optim.Adam(mine, lr=args.lr)", "torch.optim.Adam(model.parameters(), lr=args.lr)")],
}


@pytest.mark.parametrize(("key", "diagnosis"), LAUNCHED_MISTAKES, ids=lambda v: v)
def test_launched_mistake_gets_its_hint(key, diagnosis, run_check):
    result = run_check(key, mutate(key, *LAUNCHED_MISTAKES[key, diagnosis]))
    assert result.diagnosis == diagnosis, result.symptom
    assert result.hint == EXERCISES[key].hints_for(diagnosis)[0]
    if diagnosis == "summed":
        assert "2.00×" in result.symptom
    if diagnosis == "hang":
        assert result.status == "error" and "line" in result.symptom
    if diagnosis == "crash":
        assert "NameError" in result.symptom and "ex2_by_hand.py line" in result.symptom
    print(f"{key}/{diagnosis}: {result.wall:.1f} s")


DEBUG_LAB = {"6a": ("hang", "dist.all_reduce(sums)"), "6b": ("same-order", "epoch 1"),
             "6c": ("accum-not-divided", "4.00×")}


@pytest.mark.parametrize("key", DEBUG_LAB)
def test_debugging_lab_script_as_committed_shows_its_symptom(key, run_check):
    result = run_check(key, path=SCRIPTS / EXERCISES[key].script)
    diagnosis, shown = DEBUG_LAB[key]
    assert result.diagnosis == diagnosis and shown in result.symptom, result.symptom
    assert "Hint 1/3" in result.hint or result.hint_level == 1
    print(f"{key}: {result.wall:.1f} s")


# ---------------------------------------------------------------------------------------------------------
# The notebook, headless, with the reference solutions: every check passes


@pytest.mark.notebook
def test_notebook_with_solutions_passes_every_check(tmp_path, monkeypatch):
    import shutil

    from course import RUNS
    from course.run_notebooks import execute

    monkeypatch.setenv("COURSE_QUICK", "1")
    monkeypatch.setenv("COURSE_EXERCISE_SOLUTIONS", "1")
    results_dir = RUNS / "09_build_it_yourself" / "with_solutions"
    shutil.rmtree(results_dir, ignore_errors=True)
    before = {p: p.read_bytes() for p in SCRIPTS.glob("ex*.py")}
    ok, seconds, error = execute(ROOT / "notebooks" / "09_build_it_yourself.ipynb", out_dir=tmp_path)
    assert ok, error[-4000:]
    data = json.loads((results_dir / "results.json").read_text())["exercises"]
    assert {k: v["status"] for k, v in data.items()} == dict.fromkeys(EXERCISES, "pass")
    assert all(v["solutions"] for v in data.values())
    assert {p: p.read_bytes() for p in SCRIPTS.glob("ex*.py")} == before, "the run changed a committed script"
    print(f"09 with solutions: {seconds:.0f} s; per check: "
          + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in data.items()))
