"""Notebook 09's exercises with the reference solutions (COURSE_EXERCISE_SOLUTIONS=1, as the notebook's checks run
them in that mode): every check passes and no committed script is changed. The checks are called two at a time,
each with its own work folder and results file; the notebook itself runs once in the suite (tests/test_notebooks.py,
without solutions, where the stubs are reported unsolved and the debugging lab's scripts show their symptom), and
its Check yourself, answered from the key, is read from that run."""

import json
from concurrent.futures import ThreadPoolExecutor

from conftest import executed_notebook

from course import SCRIPTS
from course.exercises import EXERCISES, NOTEBOOK, check


def test_every_solution_of_notebook_09_passes_its_check(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_QUICK", "1")
    monkeypatch.setenv("COURSE_EXERCISE_SOLUTIONS", "1")
    before = {p: p.read_bytes() for p in SCRIPTS.glob("ex*.py")}
    ours = [key for key, ex in EXERCISES.items() if ex.notebook == NOTEBOOK]

    def one(key):
        folder = tmp_path / f"ex{key}"
        check(key, work_dir=folder / "work", results_file=folder / "results.json", show=False)  # raises unless a pass
        return json.loads((folder / "results.json").read_text())["exercises"][key]

    with ThreadPoolExecutor(2) as pool:
        data = dict(zip(ours, pool.map(one, ours)))
    assert {k: v["status"] for k, v in data.items()} == dict.fromkeys(ours, "pass")
    assert all(v["solutions"] and v["script"].startswith("scripts/course/exercises/solutions/") for v in data.values())
    assert {p: p.read_bytes() for p in SCRIPTS.glob("ex*.py")} == before, "a check changed a committed script"
    print("09 with solutions, per check: " + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in data.items()))


def test_the_check_yourself_of_notebook_09_passes_from_its_key():
    assert "PASS: padded to 4 shares of 76, the count is 304" in executed_notebook(NOTEBOOK).require_ok().output()
