"""Notebook 09 headless with the reference solutions (COURSE_EXERCISE_SOLUTIONS=1) and the answer key: every
check passes, the Check yourself passes, and no committed script is changed by the run. (The run without
solutions, where every stub is reported unsolved, is tests/test_notebooks.py's.)"""

import json
import shutil

import pytest

from course import ROOT, RUNS, SCRIPTS
from course.exercises import EXERCISES, NOTEBOOK


@pytest.mark.notebook
def test_notebook_with_solutions_passes_every_check(tmp_path, monkeypatch):
    from course.run_notebooks import execute

    monkeypatch.setenv("COURSE_QUICK", "1")
    monkeypatch.setenv("COURSE_ANSWER_KEY", "1")
    monkeypatch.setenv("COURSE_EXERCISE_SOLUTIONS", "1")
    results_dir = RUNS / NOTEBOOK / "with_solutions"
    shutil.rmtree(results_dir, ignore_errors=True)
    before = {p: p.read_bytes() for p in SCRIPTS.glob("ex*.py")}
    ok, seconds, error = execute(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb", out_dir=tmp_path)
    assert ok, error[-4000:]
    data = json.loads((results_dir / "results.json").read_text())["exercises"]
    ours = [key for key, ex in EXERCISES.items() if ex.notebook == NOTEBOOK]
    assert {k: v["status"] for k, v in data.items()} == dict.fromkeys(ours, "pass")
    assert all(v["solutions"] for v in data.values())
    assert {p: p.read_bytes() for p in SCRIPTS.glob("ex*.py")} == before, "the run changed a committed script"
    executed = (tmp_path / f"{NOTEBOOK}.ipynb").read_text()
    assert "PASS: padded to 4 shares of 76, the count is 304" in executed  # the Check yourself, from the key
    print(f"09 with solutions: {seconds:.0f} s; per check: "
          + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in data.items()))
