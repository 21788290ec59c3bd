"""Exercise 3 (a DistributedSampler by hand), checked in this process: its cases of the checker's test set
(course.exercises.mutations): each realistic mistake fails with its own diagnosis, including padding that must
repeat a data set smaller than the number of ranks and a sampler that reseeds the global generator, and the
correct alternatives (the solution, a differently written sampler) pass."""

import pytest
from exercise_helpers import mutate, run_check_fixture  # noqa: F401 - the run_check fixture

from course.exercises import EXERCISES
from course.exercises.mutations import by_key

CASES = [c for c in by_key("3") if not c.group.startswith("held-out")]  # the held-out sets: the benchmark's alone
SAYS = {"crash": ("AttributeError", "line"), "padded only once": ("n=1, 3 rank(s)",),  # only a set smaller
        "the global generator reseeded": ("torch's",)}                                 # than the padding shows it


def test_sampler_solution_passes(run_check):
    result = run_check("3", path=EXERCISES["3"].solution)
    assert result.passed, result.symptom
    assert "224 cases" in result.symptom and "sizes 16, 11, 13, 10, 3, 2, 1" in result.symptom


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sampler_case_gets_its_verdict(case, run_check):
    result = run_check("3", case.script())
    if case.correct:
        assert result.passed, result.symptom
        return
    assert not result.passed and result.diagnosis == case.expect, result.symptom
    assert result.hint == EXERCISES["3"].hints_for(case.expect)[0]
    for shown in SAYS.get(case.name, SAYS.get(case.expect, ())):
        assert shown in result.symptom, result.symptom


def test_sampler_that_never_returns_is_interrupted(run_check, monkeypatch):
    from course.exercises import running

    monkeypatch.setattr(running, "CALL_LIMIT_S", 2)  # the limit is read at each call; 10 s in the course
    text = mutate("3", ("        return iter(indices[self.rank::self.num_replicas])",
                        "        while True:\n            pass"))
    result = run_check("3", text)
    assert (result.status, result.diagnosis) == ("error", "hang") and "did not return within 2 s" in result.symptom
    assert result.seconds < 12
