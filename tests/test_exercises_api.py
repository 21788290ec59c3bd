"""The checker's API without launching anything: every stub is reported unsolved with as many gaps as lines
marked TODO, a syntax error names its line, hints escalate and never start with the answer, the progress
table keeps whole results, and stubs and solutions differ only where the stub is marked."""

import io
import tokenize
from contextlib import redirect_stdout

import pytest
from exercise_helpers import mutate, run_check_fixture  # noqa: F401 - the run_check fixture

from course import SCRIPTS, exercises
from course.exercises import EXERCISES, hint, progress, progress_rows
from course.exercises.hints import COMMON_HINTS
from course.scriptdiff import script_diff


def todo_lines(text: str) -> list[int]:
    return sorted({tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                   if tok.type == tokenize.COMMENT and tok.string.lstrip("# ").startswith("TODO")})


# Every exercise whose committed script has TODO lines is a stub; the others (the debugging lab) are broken
# scripts whose solution marks its fix with "The fix". A new exercise is tested here without a new line.
STUBS = [key for key, ex in EXERCISES.items() if todo_lines((SCRIPTS / ex.script).read_text())]
FIXES = [key for key in EXERCISES if key not in STUBS]


@pytest.mark.parametrize("key", STUBS)
def test_committed_stub_is_not_solved_and_counts_every_todo_line(key, run_check):
    stub = SCRIPTS / EXERCISES[key].script
    result = run_check(key, path=stub)
    assert (result.status, result.diagnosis) == ("not solved", "gaps")
    todos = todo_lines(stub.read_text())
    assert result.symptom.startswith(f"{len(todos)} gap"), result.symptom
    assert [int(line.split()[1]) for line in result.symptom.splitlines()[1:]] == todos
    assert "Replace each `...`" in result.hint
    assert result.seconds < 5, "a stub must be reported without running anything (a launch takes longer)"


@pytest.mark.parametrize("key", ["1", "2", "4", "5"])
def test_stubs_leave_the_device_lines_to_the_learner(key):
    """The exercises that start a process group leave the device and backend lines as gaps (the debugging lab's
    scripts, 6a-c, are whole scripts with one bug each, so they keep course.hardware's lines)."""
    text = (SCRIPTS / EXERCISES[key].script).read_text()
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert not any("pick_device" in line or "backend_for" in line for line in imports)
    assert "device = ...  # TODO" in text
    if key == "1":  # converting a script: joining the group is the learner's too; the stub names the tools
        assert "init_process_group" not in text
        assert "torch.accelerator.current_accelerator()" in text and "dist.get_default_backend_for_device" in text


@pytest.mark.parametrize("key", STUBS)
def test_stub_and_solution_differ_only_at_the_todo_lines(key):
    diff = script_diff(SCRIPTS / EXERCISES[key].script, EXERCISES[key].solution, marker=r"# TODO", context=0)
    assert diff.unmarked == [], "changed lines without a # TODO in the stub:\n" + "\n".join(diff.unmarked)


@pytest.mark.parametrize("key", FIXES)
def test_debugging_lab_solution_changes_only_the_marked_fix(key):
    diff = script_diff(SCRIPTS / EXERCISES[key].script, EXERCISES[key].solution, marker=r"The fix", context=0)
    assert diff.hunks and any("The fix" in h for h in diff.hunks)
    for hunk in diff.unmarked:  # apart from the marked fix, only the buggy line itself may go
        changed = [line for line in hunk.splitlines()[1:] if line[:1] in "+-"]
        assert all(line.startswith("-") for line in changed) and len(changed) <= 2, hunk


def test_syntax_error_is_reported_with_its_line(run_check):
    text = mutate("2", ("def average_gradients(model, world_size):", "def average_gradients(model, world_size)"))
    line = text.splitlines().index("def average_gradients(model, world_size)") + 1
    result = run_check("2", text)
    assert (result.status, result.diagnosis) == ("error", "syntax")
    assert f"SyntaxError in ex2_by_hand.py, line {line}" in result.symptom


def test_hints_escalate_and_never_start_with_the_answer(run_check):
    text = mutate("3", ("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)"))
    levels = [run_check("3", text).hint_level for _ in range(2)]
    assert levels == [1, 2]
    shown = hint("3", results_file=run_check.results)
    assert "Hint 3/3" in shown and "solution('3')" in shown
    first = EXERCISES["3"].hints_for("same-every-epoch")[0]
    assert "self.epoch" not in first, "the first hint must describe the symptom, not the fix"
    rows = {r["exercise"]: r for r in progress_rows(run_check.results)}
    assert rows["3"]["status"] == "fail" and rows["3"]["checks"] == 2 and rows["1"]["status"] == "not tried"


def test_progress_keeps_every_result_whole(run_check):
    result = run_check("1", path=SCRIPTS / EXERCISES["1"].script)
    out = io.StringIO()
    with redirect_stdout(out):
        progress(run_check.results)
    text = out.getvalue()
    assert all(len(line) <= 110 for line in text.splitlines()), text
    first_line = result.symptom.splitlines()[0].rstrip(":")
    assert " ".join(text.split()).count(" ".join(first_line.split())) == 1, "the last result must be shown whole"


def test_report_is_given_its_exercise(run_check):
    result = run_check("3", mutate("3", ("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)")))
    report = result.report(EXERCISES["3"])
    assert report.startswith("Exercise 3 · A DistributedSampler by hand") and "Hint 1/3" in report


def test_every_exercise_has_hints_for_its_own_diagnoses():
    assert set(exercises.MODULES) and len(EXERCISES) >= 8 and STUBS[:5] == ["1", "2", "3", "4", "5"]
    for ex in EXERCISES.values():
        assert ex.solution.exists() and (SCRIPTS / ex.script).exists()
        for diagnosis, hints in {**COMMON_HINTS, **ex.hints}.items():
            assert hints and all(isinstance(h, str) and h for h in hints), (ex.key, diagnosis)


def _traceback(rank: int, path, line: int, code: str, error: str) -> str:
    return "".join(f"[rank{rank}]:{text}\n" for text in (
        "Traceback (most recent call last):", f'  File "{path}", line {line}, in main', f"    {code}", error))


@pytest.mark.parametrize("partner", [("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                                     "closed by peer [127.0.0.1]:41235"), None])
def test_a_rank_that_crashes_is_the_cause_not_a_hang(tmp_path, partner):
    """Issue 34: rank 1 raises its own error; rank 0 then reports the closed connection (or is stopped by
    torchrun, saying nothing): a crash of rank 1, at its line, not a hang."""
    from course.exercises.results import Stop
    from course.exercises.running import Run, failure

    path = (tmp_path / "ex.py").resolve()
    output = _traceback(1, path, 12, "print(losss)", "NameError: name 'losss' is not defined")
    if partner:
        output = _traceback(0, path, 30, "dist.barrier()", partner) + output
    with pytest.raises(Stop) as stopped:
        failure(Run(1, output, {}, tmp_path, 1.0), path, 90)
    verdict = stopped.value.verdict
    assert (verdict.status, verdict.diagnosis, verdict.facts["rank"]) == ("error", "crash", 1)
    assert verdict.symptom.startswith("rank 1 crashed at ex.py line 12: `print(losss)`: NameError"), verdict.symptom


def test_ranks_that_only_gave_up_on_each_other_are_a_hang(tmp_path):
    from course.exercises.results import Stop
    from course.exercises.running import Run, failure

    path = (tmp_path / "ex.py").resolve()
    output = (_traceback(0, path, 30, "dist.all_reduce(x)", "RuntimeError: [pair.cc:534] Timed out waiting 10000ms")
              + _traceback(1, path, 40, "dist.barrier()", "RuntimeError: Connection closed by peer [127.0.0.1]:1"))
    with pytest.raises(Stop) as stopped:
        failure(Run(1, output, {}, tmp_path, 1.0), path, 90)
    verdict = stopped.value.verdict
    assert verdict.diagnosis == "hang" and "rank 0 waited at ex.py line 30" in verdict.facts["detail"]


def test_a_receive_buffer_of_another_size_is_a_shape_crash_not_a_hang(tmp_path):
    """Issue 44 item 3 (exercise 8's held-out gradient buffer without its feature axis): gloo aborts the receiver
    ("16384 vs 256. Received data size doesn't match expected size") and its partner's send fails. This was told
    as an unmatched collective (a hang); with a point-to-point line in the run it is a buffer of the wrong shape.
    The same message between collectives (no send or recv) stays a mismatch of collectives."""
    from course.exercises.results import Stop
    from course.exercises.running import Run, failure

    path = (tmp_path / "ex.py").resolve()
    gloo = ("what():  [enforce fail at gloo/transport/tcp/pair.cc:464] op.preamble.length <= op.nbytes. 16384 vs "
            "256. Received data size doesn't match expected size.")
    partner = "RuntimeError: Read error [127.0.0.1]:48821: Connection reset by peer"
    for line, code, diagnosis in ((55, "dist.send(inputs[i].grad, dst=0)", "crash-shape"),
                                  (40, "dist.all_reduce(x)", "hang")):
        output = f"[rank0]:terminate called after throwing an instance of 'gloo::EnforceNotMet'\n[rank0]:  {gloo}\n" \
            + _traceback(1, path, line, code, partner)
        with pytest.raises(Stop) as stopped:
            failure(Run(-6, output, {}, tmp_path, 1.0), path, 90)
        verdict = stopped.value.verdict
        assert verdict.diagnosis == diagnosis, verdict.symptom
    shape = failure.__globals__["SIZES"].search(gloo)
    assert shape and shape.groups() == ("16384", "256")


SHARED = {"compare_traces(": ("steps", "no-broadcast", "wrong-start", "ranks-differ", "summed", "halved", "factor",
                              "differs", "loss-differs"),
          "failure(": ("hang", "crash", "crash-shape"), "load_trace": ("no-trace",), "load_metrics": ("no-output",)}


@pytest.mark.parametrize("key", list(EXERCISES))
def test_every_diagnosis_a_check_can_reach_has_a_hint_written_for_it(key):
    """Issue 34: a diagnosis without hints of its own or common ones fell back to another exercise's text."""
    import ast
    import inspect
    import re
    import sys

    module = sys.modules[EXERCISES[key].check.__module__]
    others = {ex.check.__name__ for ex in EXERCISES.values() if ex.check.__module__ == module.__name__} \
        - {EXERCISES[key].check.__name__}  # the debugging lab: three checks in one module
    source = "\n".join(ast.get_source_segment(inspect.getsource(module), node)
                       for node in ast.parse(inspect.getsource(module)).body
                       if not (isinstance(node, ast.FunctionDef) and node.name in others))
    reached = set(re.findall(r'fail\(\s*"([a-z0-9-]+)"', source)) | set(re.findall(r'diagnosis = "([a-z0-9-]+)"', source))
    reached |= {d for call, names in SHARED.items() if call in source for d in names} | {"missing", "syntax", "gaps"}
    written = set(EXERCISES[key].hints) | set(COMMON_HINTS)
    assert reached <= written, f"exercise {key}: no hint written for {sorted(reached - written)}"


def test_a_hint_that_names_deep_dive_04b_names_the_core_notebook_first():
    """Issue 52: "where the course teaches it" sent core-path learners to deep dive 04b for what notebook 03 step 5
    teaches (collectives on every rank, printing on rank 0) and for what 03's proof 1 does (comparing a step with
    one process's). A hint may name 04b, after the core notebook (00, 03 or 04) that teaches it."""
    import re

    texts = {(key, diagnosis, rung): text for key, ex in EXERCISES.items()
             for diagnosis, rungs in {**COMMON_HINTS, **ex.hints}.items() for rung, text in enumerate(rungs)}
    core = re.compile(r"\b[Nn]otebooks? 0[034]\b(?!b)")
    late = {where: text for where, text in texts.items() if "04b" in text
            and not (core.search(text) and core.search(text).start() < text.index("04b"))}
    assert any("04b" in text for text in texts.values()) and not late, late
