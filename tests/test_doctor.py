"""The DDP doctor (course.doctor) on scripts the course did not write for itself: every case of
tests/fixtures/doctor/cases.json (the pitfalls of 04/04b that show on a CPU, exercise 6's bugs, the correct scripts,
learner-shaped scripts with realistic mistakes) gets exactly its expected findings, no more; the learner's folder is
left as it was; nothing is left running; the command line's exit status and one-line errors."""

import json
import subprocess
import sys

import pytest
from conftest import wait_for_no_processes

from course import ROOT
from course.doctor import Facts, cases, rules_sync
from course.doctor.report import COST, Finding, Report

CASES = cases.load(bench=False)


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory):
    """Every case run once, two at a time (each in a working folder of its own)."""
    return cases.run_all(CASES, tmp_path_factory.mktemp("doctor"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_doctor_makes_exactly_the_expected_findings(case, outcomes):
    outcome = outcomes[case.name]
    report = outcome.report
    assert outcome.found == sorted(case.expect), f"{case.name}:\n{report.text()}"
    mistakes = [f for f in report.findings if f.kind != COST]
    assert report.status == (1 if mistakes else 2 if report.error else 0), report.text()
    for finding in report.findings:  # one line each: what, evidence, fix, lesson
        line = finding.line()
        assert "\n" not in line and finding.evidence and finding.fix and finding.lesson, line


def test_correct_scripts_are_clean_and_mistakes_have_evidence(outcomes):
    clean = [o for o in outcomes.values() if o.case.group == "correct"]
    assert len(clean) >= 14 and all(o.report.status == 0 and not o.report.findings for o in clean)
    set_epoch = outcomes["pitfall-2-set-epoch"].report.findings[0]
    assert "epoch was 0 both times" in set_epoch.evidence and "first samples" in set_epoch.evidence
    uneven = outcomes["pitfall-7-uneven"].report.findings[0]
    assert "rank 0: 5 batches, rank 1: 4 batches" in uneven.evidence
    one_shard = outcomes["exercise-6a"].report.findings[0]  # the hang it causes is told as its consequence
    assert "the job then hung" in one_shard.evidence and "rank 1 in barrier at ex6a_debug.py" in one_shard.evidence
    mismatch = outcomes["pitfall-12-collective"].report.findings[0].evidence
    assert "rank 0 called all_reduce" in mismatch and "rank 1 called barrier" in mismatch
    assert "pitfall_collective.py:" in mismatch  # the line of each rank


def test_a_hang_names_where_each_rank_was(outcomes):
    """Rank 0 in an all_reduce, rank 1 in a loop without collectives: at the wall-clock limit each rank said where."""
    hang = outcomes["hang-without-timeout"].report.findings[0]
    assert "rank 0 in all_reduce at hang_forever.py:10" in hang.evidence, hang.evidence
    assert "rank 1 at hang_forever.py:13, in no collective" in hang.evidence, hang.evidence
    assert wait_for_no_processes("hang_forever.py", timeout=10) == []


def test_nothing_is_left_running_after_any_case(outcomes):
    for script in {str(o.case.script) for o in outcomes.values()}:
        assert wait_for_no_processes(script, timeout=10) == [], script


def test_the_learners_folder_is_as_it_was(outcomes):
    """Files the script overwrote are restored; files it created are moved to the doctor's folder."""
    outcome = outcomes["learner-trainer-class"]
    assert (outcome.cwd / "checkpoint.pt").read_text() == "the learner's own checkpoint"
    writes = outcomes["learner-save-every-rank"]
    assert sorted(p.name for p in writes.cwd.iterdir()) == []  # runs_local/ was created by the run: gone
    moved = {p.name for p in writes.folder.rglob("*") if p.is_file() and "files" in p.relative_to(writes.folder).parts}
    assert {"last.pt", "log.csv"} <= moved and any(n.startswith("events.out.tfevents") for n in moved)


def test_a_script_that_fails_on_its_own_is_shown_once(outcomes):
    report = outcomes["crashes-on-its-own"].report
    assert report.status == 2 and report.text().count("KeyError: 'learning_rate'") == 1, report.text()
    assert "rank 1" in report.error


def test_one_process_against_n_is_the_equivalence_proof(outcomes):
    wrong = outcomes["learner-by-hand-sum"].report.findings[0]
    assert wrong.code == "not-equivalent" and "then step 1 differs" in wrong.seen
    assert any("1 process against 2" in c for c in outcomes["learner-by-hand-fixed"].report.checked)


def test_every_rank_on_one_gpu_is_named_from_the_records():
    """The GPU-only pitfall 1, from records as two ranks on one GPU would leave them (no GPU here)."""
    records = {r: {"modules": [{"device": "cuda:0"}], "env": {}} for r in (0, 1)}
    facts = Facts("/")
    rules_sync.devices(records, facts)
    assert [f.code for f in facts.findings] == ["same-device"] and "cuda:0" in facts.findings[0].evidence
    records[1]["modules"][0]["device"] = "cuda:1"
    facts = Facts("/")
    rules_sync.devices(records, facts)
    assert facts.findings == []


def test_exit_status_follows_the_linters():
    clean, cost = Report("s", "c"), Report("s", "c", findings=[Finding("find-unused", "x", "y", "z", kind=COST)])
    wrong = Report("s", "c", findings=[Finding("set-epoch", "x", "y", "z")])
    assert (clean.status, cost.status, wrong.status, Report("s", "c", error="boom").status) == (0, 0, 1, 2)
    assert json.loads(wrong.to_json())["status"] == 1


@pytest.mark.parametrize("argv, message", [
    (["no_such_script.py"], "error: no such script: no_such_script.py"),
    (["--steps", "-1", "x.py"], "error: argument --steps: -1 must be >= 0"),
    (["--compare-batch-arg=--batch-size", "tests/fixtures/doctor/crashes.py"],
     "error: --compare-batch-arg=--batch-size: the script's arguments hold no `--batch-size N` to split"),
])
def test_bad_input_gets_one_line_and_status_2(argv, message):
    result = subprocess.run([sys.executable, "-m", "course.doctor", *argv], cwd=ROOT, capture_output=True, text=True,
                            check=False,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.notebook
def test_notebook_09b_finds_the_three_mistakes_and_none_after_the_fixes():
    """Read from the notebook's own headless run (conftest.executed_notebook), not launched again."""
    from conftest import executed_notebook

    run = executed_notebook("09b_check_your_script").require_ok()
    text = run.output()
    assert "before the fixes: 3 mistake(s) (set-epoch, eval-one-shard, rank-writes); after: 0" in text, text[-2000:]
    assert "PASS: 1004 samples counted for 1001" in text
