"""Every launched exercise (1, 2, 4-9) against the checker's test set (course.exercises.mutations.TESTED; the
benchmark course.bench_checker checks the whole set): each realistic mistake fails with its own diagnosis and first
hint, each correct alternative passes on the exercise's second configuration (the solutions pass on the first in
tests/test_exercises_notebook.py), a race gets the same diagnosis every run, and the debugging lab's scripts as
committed show their symptom only. One real 2-rank job per case (on Linux its ranks forked from the checker's
rank server: course.exercises.forked), two at a time: each check has its own script, work folder and results file,
and no diagnosis depends on how fast a job runs (they come from what the recorder saw, and a hang ends at the process-group timeout whatever the load)."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import torch
from conftest import charge, executed_notebook, part_of, wait_for_no_processes

from course import RUNS, SCRIPTS
from course.exercises import EXERCISES, NOTEBOOK, check, ex1_convert, ex2_by_hand, forked, hint
from course.exercises.crashes import CRASH_HINTS
from course.exercises.hints import filled
from course.exercises.mutations import CASES, TESTED, Case

LAUNCHED = [c for c in TESTED if EXERCISES[c.key].launches]
MISTAKES = [c for c in LAUNCHED if not c.correct]
ALTERNATIVES = [c for c in LAUNCHED if c.correct]
RACES = [c for c in MISTAKES if c.cls == "race"]


def check_case(case: Case, root, tag: str = ""):
    folder = root / (re.sub(r"\W+", "-", case.id) + tag)
    path = folder / EXERCISES[case.key].script
    folder.mkdir()
    path.write_text(case.script())
    start = time.monotonic()
    result = check(case.key, path, work_dir=folder / "work", results_file=folder / "results.json", show=False)
    result.wall, result.results_file = time.monotonic() - start, folder / "results.json"
    return result


def two_at_a_time(fn, items) -> list:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(fn, items))


@contextlib.contextmanager
def second_configuration():
    """Every launched exercise's check run with its module's CONFIGS[1] (the lab's 6c: CONFIGS_C[1])."""
    modules = {sys.modules[ex.check.__module__] for ex in EXERCISES.values() if ex.launches}
    patches = [mock.patch.object(m, name, getattr(m, both)[1]) for m in modules
               for name, both in (("CONFIG", "CONFIGS"), ("CONFIG_C", "CONFIGS_C")) if hasattr(m, both)]
    assert len(patches) == len(modules) + 1, "every launched exercise has a second configuration"
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


LATENT = next(c for c in CASES if c.key == "9" and c.expect == "counts")  # wrong only where an expert gets no token


@pytest.fixture(scope="module")
def checked(request, tmp_path_factory):
    """check() of every case that the selected tests of this module ask for (``-k`` runs a few), two at a time:
    the mistakes on the first configuration (each selected race twice more), then the correct alternatives and
    exercise 9's latent mistake on the second; no process left behind."""
    selected = [item for item in request.session.items if item.module is request.module
                and "case" in getattr(getattr(item, "callspec", None), "params", {})]
    wanted = [item.callspec.params["case"] for item in selected]
    if any(item.originalname == "test_every_check_holds_on_a_second_configuration" for item in request.session.items):
        wanted += ALTERNATIVES
    wanted = list(dict.fromkeys(wanted))
    again = {item.callspec.params["case"] for item in selected if item.originalname == "test_a_race_gets_the_same_diagnosis_every_run"}
    root, started = tmp_path_factory.mktemp("launched"), time.monotonic()
    first = [(c, "") for c in wanted if not c.correct] + [(c, f"-again{i}") for c in wanted if c in again for i in (1, 2)]
    second = [(c, "") for c in wanted if c.correct] + [(LATENT, "-config2")] * any(c.correct for c in wanted)
    results = dict(zip(((c.id, tag) for c, tag in first), two_at_a_time(lambda w: check_case(w[0], root, w[1]), first)))
    with second_configuration():
        results.update(zip(((c.id, tag) for c, tag in second),
                           two_at_a_time(lambda w: check_case(w[0], root, w[1] or "-config2"), second)))
    assert wait_for_no_processes(str(root), timeout=10) == [], "processes of a check left behind"
    assert forked.live_ranks() == [], "forked ranks of a check left behind"
    walls = sorted(r.wall for r in results.values())
    charge(time.monotonic() - started, {part: sum(r.wall for (case, _), r in results.items()
                                                  if part_of(case.partition("/")[0]) == part) for part in ("00-09", "10-12")})
    print(f"{len(walls)} checks: median {walls[len(walls) // 2]:.1f} s, max {walls[-1]:.1f} s")
    return results


@pytest.mark.parametrize("case", MISTAKES, ids=lambda c: c.id)
def test_mistake_gets_the_first_hint_for_it(case, checked):
    result = checked[case.id, ""]
    assert (result.status != "pass", result.diagnosis) == (True, case.expect), result.symptom
    rung = filled(EXERCISES[case.key].hints_for(case.expect)[0], result.facts.get("detail"))
    assert result.hint_level == 1 and result.hint.endswith(rung)
    if case.expect.startswith("crash") and result.facts.get("reading"):  # issue 55: the failing line read first
        assert result.hint == f"{result.facts['reading']} {rung}" and result.hint.startswith("Line "), result.hint
    assert case.expect in EXERCISES[case.key].hints or case.expect in ("hang", "crash", "factor", *CRASH_HINTS), \
        "a hint of its own"
    if case.cls == "crash":  # the rank's own error and line, not its partner's closed connection
        assert "crashed at" in result.symptom and "Connection closed" not in result.symptom, result.symptom
        assert result.hint.startswith("Line "), result.hint  # issue 55: the failing line and what its names held
    if case.expect in ("summed", "loss-summed"):
        assert "2.00×" in result.symptom or "exactly 2×" in result.symptom


@pytest.mark.parametrize("case", ALTERNATIVES, ids=lambda c: c.id)
def test_correct_alternative_passes(case, checked):
    result = checked[case.id, ""]
    assert result.passed, result.symptom


@pytest.mark.parametrize("case", RACES, ids=lambda c: c.id)
def test_a_race_gets_the_same_diagnosis_every_run(case, checked):
    seen = {checked[case.id, tag].diagnosis for tag in ("", "-again1", "-again2")}
    assert seen == {case.expect}


def test_the_set_covers_every_class_of_checker_error():
    """Issue 34: each class of wrong verdict the checker made has mistakes (and alternatives) of its own here."""
    classes = {c.cls for c in TESTED}  # every class in the tests, the rest of the set in the benchmark
    assert {"false-pass", "false-fail", "averaged", "crash", "shape", "splits", "own-hint", "race"} <= classes
    assert len({c.id for c in CASES}) == len(CASES), "a case id twice: the benchmark keys its runs by id"
    per_exercise = {key: [c for c in CASES if c.key[0] == key] for key in "123456789"}
    assert all(sum(not c.correct for c in cases) >= 6 and any(c.correct for c in cases)
               for cases in per_exercise.values()), {k: len(v) for k, v in per_exercise.items()}


def test_every_check_holds_on_a_second_configuration(checked):
    """Each launched exercise has a correct alternative here, checked on the second configuration (the solutions
    pass on the first: tests/test_exercises_notebook.py), and exercise 9's latent mistake (a count without
    minlength) is named there too: the checks are not tuned to one configuration."""
    assert {c.key for c in ALTERNATIVES} == {k for k, ex in EXERCISES.items() if ex.launches}
    assert all(checked[c.id, ""].passed for c in ALTERNATIVES)
    assert checked[LATENT.id, "-config2"].diagnosis == LATENT.expect, checked[LATENT.id, "-config2"].symptom


DEBUG_LAB = {"6a": ("hang", "line", "hint('6a')"), "6b": ("same-order", "same", "hint('6b')"),
             "6c": ("accum-not-divided", "×", "hint('6c')")}


@pytest.mark.parametrize("key", DEBUG_LAB)
def test_debugging_lab_as_committed_shows_the_symptom_only(key):
    """Read from notebook 09's headless run (conftest.executed_notebook), which checks the committed scripts:
    the first check shows the symptom and points at hint(); what names the cause is kept for the hint ladder."""
    run = executed_notebook(NOTEBOOK).require_ok()
    result = json.loads(run.written(RUNS / NOTEBOOK / "results.json").read_text())["exercises"][key]
    diagnosis, in_detail, pointer = DEBUG_LAB[key]
    assert result["diagnosis"] == diagnosis and pointer in result["symptom"], result["symptom"]
    assert in_detail not in result["symptom"] and in_detail in result["detail"], result
    assert result["script"] == f"scripts/{EXERCISES[key].script}" and result["hint_level"] >= 1


def test_the_hint_ladder_gives_what_the_first_check_held_back(tmp_path):
    """6a as committed, read from notebook 09's headless run: the second rung shows where each rank waited. The
    results file keeps a learner's hint levels across runs of the notebook: in a checkout where 09 ran before
    (`make test` twice) 6a has been checked again and its ladder is further on; the copy is then put back to
    where one check leaves it, with this run's symptom and detail."""
    run = executed_notebook(NOTEBOOK).require_ok()
    results = shutil.copy(run.written(RUNS / NOTEBOOK / "results.json"), tmp_path / "results.json")
    data = json.loads((tmp_path / "results.json").read_text())
    first = data["exercises"]["6a"]
    assert first["hint_level"] == 1 or first["checks"] > 1, first  # one check: the first rung
    assert "line" not in first["symptom"] and "line" in first["detail"], first
    if first["hint_level"] != 1:  # as one check of this diagnosis leaves it
        first.update(checks=1, seen={first["diagnosis"]: 1}, extra_hints={}, hint_level=1)
        results.write_text(json.dumps(data))
    shown = hint("6a", results_file=results)
    assert "Hint 2/3: Where each rank was: " + first["detail"] in shown, shown


def test_single_device_script_is_the_reference(tmp_path):
    """Exercise 1's reference (computed in-process by the checker) is what ex1_single.py computes."""
    seed = ex1_convert.CONFIG["seed"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPTS / "ex1_single.py"), "--out", str(tmp_path), "--seed", str(seed)],
                   check=True, capture_output=True, env=env, timeout=120)
    ref = ex1_convert.reference()
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log if "loss" in r] == pytest.approx(ref.losses, abs=1e-5)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    for (name, value), expected in zip(state.items(), ref.params[-1], strict=True):
        torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-4, msg=name)
    assert (log[-1]["val_correct"], log[-1]["val_total"]) == ref.val


def test_two_simulated_ranks_equal_the_single_process_reference():
    """What every check relies on: 2 ranks x B/2 with averaged gradients = 1 process x B, to float rounding."""
    one, two = ex2_by_hand.reference(), ex2_by_hand.reference(2)
    for a, b in zip(one.params[-1], two.params[-1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
