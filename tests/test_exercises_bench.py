"""The checker's benchmark (python -m course.bench_checker, in make bench) on exercise 3's cases, which run in this
process: it writes its rates and every case's diagnosis to metrics.json, and counts a planted wrong verdict."""

import json
from unittest import mock

from course import bench_checker
from course.exercises import mutations
from course.exercises.mutations import Case, by_key


def test_bench_writes_the_rates_of_the_cases_it_ran(tmp_path):
    metrics = bench_checker.main(["--only", "3", "--group", "older", "rungs", "--jobs", "1",
                                  "--run-dir", str(tmp_path / "bench")])
    written = json.loads((tmp_path / "bench" / "metrics.json").read_text())
    cases = [c for c in by_key("3") if not c.group.startswith("held-out")]  # the held-out sets: the benchmark's alone
    assert written["mistakes"] == sum(not c.correct for c in cases) == metrics["mistakes"]
    assert (written["false_pass"], written["false_fail"], written["first_hint_rate"]) == (0, 0, 1.0)
    assert written["first_rung"]["named"] == written["mistakes"] and written["per_group"]["older"]["mistakes"] > 0
    assert written["per_exercise"]["3"]["correct_alternatives"] == sum(c.correct for c in cases)
    assert {r["case"] for r in written["cases"]} == {c.id for c in cases} and written["processes_left"] == 0


def test_bench_counts_a_wrong_verdict_as_wrong(tmp_path):
    """A mistake listed under another diagnosis, and a wrong solution listed as correct: both are counted."""
    solution = Case("3", "the solution, named as a mistake", "overlap")
    broken = Case("3", "a broken sampler, listed as correct", "pass",
                  (("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)"),))
    with mock.patch.object(mutations, "CASES", [solution, broken]):
        metrics = bench_checker.main(["--only", "3", "--jobs", "1", "--run-dir", str(tmp_path / "bench")])
    assert metrics["false_pass_cases"] == ["3/the solution, named as a mistake"]
    assert metrics["false_fail_cases"] == ["3/a broken sampler, listed as correct"]
    assert metrics["first_hint_rate"] == 0.0
    assert metrics["first_rung"] == {"named": 0, "generic": 0, "misleading": 0, "passed": 1, "to judge": 0}
    assert [r["first_rung"] for r in metrics["cases"]] == ["passed", None]  # a correct alternative has no rung
