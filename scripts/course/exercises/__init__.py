"""Exercises checked by running them: the learner's script on 2 processes against a single-process reference,
step by step, answering **PASS** or a hint in plain words. The API and the registry of exercises.

    from course import exercises
    exercises.check("2")      # launch scripts/ex2_by_hand.py on 2 processes, compare it with the reference
    exercises.hint("2")       # the next, more precise hint for exercise 2's last mistake
    exercises.solution("2")   # the reference solution, as a diff against your script
    exercises.progress()      # every exercise's status, from runs/<notebook>/results.json

How a check works: the script is read first (a syntax error or a gap still marked ``...  # TODO`` is
reported without running anything: ``running.static_check``); then the exercise's own ``check`` launches
it under the recorder (``running.launch``, ``ddp_doctor/recorder/recorder.py``; on Linux its ranks are forks of a
process that imported torch once, ``forked``) with a wall-clock limit and a short process-group
timeout, rebuilds the same training in this process (``reference.simulate``) and compares; the first
difference becomes a diagnosis, and each diagnosis a rung of the hint ladder (``hints``); a crash is named by
its kind from the crashing rank's error (``crashes``).
``COURSE_EXERCISE_SOLUTIONS=1``: every check runs the reference solution instead (the tests run the
notebook so); results then go to ``runs/<notebook>/with_solutions/`` and anything but a pass raises.

To add an exercise (say key "7", script ``ex7_tensor.py``, in notebook ``10_tensor_parallel``):
1. write ``course/exercises/ex7_tensor.py``: a docstring, ``CONFIG``, ``reference()``, and
   ``check(path, work, *, backend, timeout) -> Verdict``, built from ``running.launch``/``failure``/
   ``load_traces`` and ``reference.simulate``/``compare_traces`` (end with ``fail(diagnosis, symptom)``
   for a mistake, return ``Verdict("pass", "pass", symptom)``); ``HINTS = {diagnosis: [symptom, tool,
   cause]}``; and ``EXERCISES = [Exercise("7", "Title", "ex7_tensor.py", check, HINTS,
   notebook="10_tensor_parallel")]``;
2. add the module's name to ``MODULES`` below;
3. put the stub in the notebook's ``%%writefile ../scripts/ex7_tensor.py`` cell (gaps as
   ``...  # TODO ...``, one per line marked TODO) and the reference solution in
   ``course/exercises/solutions/ex7_tensor.py``; the tests hold them equal outside the TODO lines and
   run the solution through the check;
4. give the module ``CONFIGS = (CONFIG, another)`` (the tests run the check on both), and add its realistic
   mistakes and correct alternatives to ``course/exercises/mutations/`` (the tests hold each to its
   diagnosis; ``python -m course.bench_checker`` measures the checker's false PASS, false FAIL and
   first-hint rates over them).
"""

import importlib
import os
import time
from datetime import datetime
from pathlib import Path

from course import SCRIPTS
from course.exercises import crashes, table
from course.exercises.hints import filled, level
from course.exercises.reference import NPROC
from course.exercises.results import (
    NOTEBOOK,
    SOLUTIONS,
    CheckResult,
    Exercise,
    Results,
    Stop,
    rel,
    solutions_mode,
)
from course.exercises.running import LAUNCH_TIMEOUT_S, static_check
from course.notebook import in_notebook

MODULES = ("ex1_convert", "ex2_by_hand", "ex3_sampler", "ex4_overlap", "ex5_zero1", "ex6_debug", "ex7_tp",
           "ex8_pipeline", "ex9_experts")

EXERCISES: dict[str, Exercise] = {
    ex.key: ex for name in MODULES for ex in importlib.import_module(f"course.exercises.{name}").EXERCISES}

__all__ = ["EXERCISES", "NOTEBOOK", "SOLUTIONS", "CheckResult", "Exercise", "check", "hint", "progress",
           "progress_rows", "solution", "solutions_mode"]


def _exercise(key) -> Exercise:
    key = str(key)
    if key not in EXERCISES:
        raise ValueError(f"no exercise {key!r}; there are {', '.join(EXERCISES)}")
    return EXERCISES[key]


def check(exercise: str | int, script: str | os.PathLike | None = None, *, work_dir=None, results_file=None,
          backend: str = "gloo", timeout: float = LAUNCH_TIMEOUT_S, show: bool = True) -> CheckResult:
    """Check one exercise; print and return the result. Never raises for a wrong or broken script
    (except in COURSE_EXERCISE_SOLUTIONS mode, where anything but a pass raises AssertionError).

    script: the file to check (default: the exercise's file in scripts/); work_dir: where its run writes
    (default: runs/<notebook>/ex<N>); results_file: where statuses and hint levels are kept.
    """
    ex = _exercise(exercise)
    note = ""
    if script is None and solutions_mode():
        path = ex.solution
        note = f"COURSE_EXERCISE_SOLUTIONS=1: checking the reference solution instead of scripts/{ex.script}"
    else:
        path = Path(script) if script is not None else SCRIPTS / ex.script
    results = Results(results_file, ex.notebook)
    work = (Path(work_dir) if work_dir else results.path.parent / f"ex{ex.key}").resolve()
    if show and note:
        print(note)
    start = time.monotonic()
    verdict = static_check(path)
    if verdict is None:
        if show and ex.launches:
            print(f"running {rel(path)} on {NPROC} processes and the single-process reference ...", flush=True)
        try:
            verdict = ex.check(path, work, backend=backend, timeout=timeout)
        except Stop as stop:
            verdict = stop.verdict
        verdict = crashes.named(verdict)  # a crash of a known kind (after the exercise's own reading of it)
    seconds = time.monotonic() - start
    if verdict.facts.get("launched") and (work / "output.txt").exists():
        verdict.facts["output"] = rel(work / "output.txt")

    entry = results.entry(ex.key)
    entry["checks"] += 1
    rung, hint_text = 0, ""
    if verdict.status != "pass":
        hints = ex.hints_for(verdict.diagnosis)
        if verdict.status == "not solved":
            rung = 1
        else:
            seen = entry["seen"][verdict.diagnosis] = entry["seen"].get(verdict.diagnosis, 0) + 1
            rung = level(seen, entry["extra_hints"].get(verdict.diagnosis, 0), len(hints))
        hint_text = filled(hints[rung - 1], verdict.facts.get("detail"))
        if rung == 1:
            hint_text = crashes.first_hint(verdict, hint_text)  # a crash: its failing line and what its names held
    entry.update(status=verdict.status, diagnosis=verdict.diagnosis, symptom=verdict.symptom,
                 detail=verdict.facts.get("detail") or "",
                 reading=(verdict.facts.get("reading") or "") if verdict.diagnosis.startswith("crash") else "",
                 seconds=round(seconds, 1), when=datetime.now().isoformat(timespec="seconds"),
                 script=rel(path), hint_level=rung, solutions=bool(note))
    if verdict.status == "pass":
        entry["passed_once"] = True
    results.save()
    result = CheckResult(ex.key, verdict.status, verdict.diagnosis, verdict.symptom, hint_text, rung, seconds,
                         rel(path), verdict.facts)
    if show:
        print(result.report(ex), flush=True)
    if note and not result.passed:
        raise AssertionError(f"the reference solution of exercise {ex.key} did not pass: {verdict.symptom}")
    return result


def hint(exercise: str | int, results_file=None) -> str:
    """Print every hint given so far for the exercise's last mistake, plus the next one."""
    ex = _exercise(exercise)
    key = ex.key
    results = Results(results_file, ex.notebook)
    entry = results.entry(key)
    diagnosis = entry.get("diagnosis")
    if not diagnosis or entry.get("status") == "pass":
        text = (f"Exercise {key}: nothing to hint at" + (" — it passes." if entry.get("status") == "pass" else
                f" yet: run check('{key}') first."))
        print(text)
        return text
    hints = ex.hints_for(diagnosis)
    if entry.get("status") == "not solved":
        shown = 1
    else:
        entry["extra_hints"][diagnosis] = entry["extra_hints"].get(diagnosis, 0) + 1
        shown = level(entry["seen"].get(diagnosis, 0), entry["extra_hints"][diagnosis], len(hints))
        entry["hint_level"] = shown
        results.save()
    lines = [f"Exercise {key} · {ex.title}: {entry.get('symptom', '')}"]
    lines += [f"Hint {i + 1}/{len(hints)}: " + (entry.get("reading", "") + " ") * (i == 0 and bool(entry.get("reading")))
              + filled(h, entry.get("detail")) for i, h in enumerate(hints[:shown])]
    if shown >= len(hints) and entry.get("status") != "not solved":
        lines.append(f"That was the last hint: solution('{key}') shows the reference solution.")
    text = "\n".join(lines)
    print(text)
    return text


def solution(exercise: str | int, script: str | os.PathLike | None = None) -> Path:
    """Show the reference solution as a diff from your script (scripts/<name>) to it; returns its path."""
    from course.scriptdiff import script_diff

    ex = _exercise(exercise)
    ref = ex.solution
    mine = Path(script) if script else SCRIPTS / ex.script
    print(f"Reference solution: {rel(ref)}" + (f"\nLines starting with - are in your {rel(mine)}, "
                                                 "lines starting with + in the solution:" if mine.exists() else ""))
    if not mine.exists():
        print(ref.read_text())
        return ref
    diff = script_diff(mine, ref, marker=r"(?!)", context=2)
    if in_notebook():
        diff.show()
    else:
        print(diff.text())
    return ref


def progress_rows(results_file=None, notebook: str = NOTEBOOK) -> list[dict]:
    """The status of every exercise of a notebook, as read from its results file."""
    return table.rows([ex for ex in EXERCISES.values() if ex.notebook == notebook], Results(results_file, notebook))


def progress(results_file=None, notebook: str = NOTEBOOK) -> None:
    """Show the status of every exercise of a notebook: a table in a notebook, text elsewhere."""
    table.show(progress_rows(results_file, notebook), Results(results_file, notebook).path)

