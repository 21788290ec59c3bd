"""Shared by the tests of notebook 09's checker (tests/test_exercises_*.py): check() on a script text or a
file, written into a temporary folder, with no process left behind; ``mutate`` (a reference solution with
edits) is course.exercises.mutations'."""

import time

import pytest

from course.exercises import EXERCISES, check
from course.exercises.mutations import mutate  # noqa: F401 - the tests' import of it


@pytest.fixture(name="run_check")
def run_check_fixture(tmp_path, wait_no_processes):
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
        assert wait_no_processes(str(work), timeout=10) == [], f"processes of the check of {path} left behind"
        return result

    run.results = results
    return run
