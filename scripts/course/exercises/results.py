"""What an exercise is, what a check found, and what is kept on disk between checks (statuses, hint levels).

- ``Exercise``: one checked exercise (key, title, script name, its check function, its hints, its notebook).
- ``Verdict``: what a check function returns (or raises with ``fail``): a status, a diagnosis, a symptom.
- ``CheckResult``: what ``check()`` returns and prints; ``report(exercise)`` is given its exercise.
- ``Results``: ``runs/<notebook>/[with_solutions/]results.json``, written atomically.
"""

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from course import ROOT, RUNS, flag
from course.exercises.hints import hints_for

NOTEBOOK = "09_build_it_yourself"  # the notebook of the exercises that do not name their own
SOLUTIONS = Path(__file__).parent / "solutions"


def solutions_mode() -> bool:
    """True when COURSE_EXERCISE_SOLUTIONS asks every check to run the reference solution."""
    return flag("COURSE_EXERCISE_SOLUTIONS")


def results_file(notebook: str = NOTEBOOK) -> Path:
    """Where a notebook's statuses are kept (with the solutions: a folder of their own)."""
    return RUNS / notebook / ("with_solutions" if solutions_mode() else "") / "results.json"


def rel(path) -> str:
    """A path as the learner reads it: relative to the course folder when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


@dataclass
class Exercise:
    """One exercise: ``check(path, work, *, backend, timeout) -> Verdict`` and hints per diagnosis."""

    key: str
    title: str
    script: str  # the file name, in scripts/ (the learner's) and in solutions/ (the reference)
    check: Callable
    hints: dict
    launches: bool = True  # False: checked in this process (no torchrun)
    notebook: str = NOTEBOOK

    @property
    def solution(self) -> Path:
        return SOLUTIONS / self.script

    def hints_for(self, diagnosis: str) -> list[str]:
        return hints_for(diagnosis, self.hints)


@dataclass
class Verdict:
    """What a check found: ``status`` is pass | fail | error | not solved; ``diagnosis`` names the mistake."""

    status: str
    diagnosis: str
    symptom: str
    facts: dict = field(default_factory=dict)


class Stop(Exception):
    """Raised inside a check to end it with a verdict."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.symptom)
        self.verdict = verdict


def fail(diagnosis: str, symptom: str, status: str = "fail", **facts):
    """End the check with this diagnosis (status fail, or error for a crash or a hang)."""
    raise Stop(Verdict(status, diagnosis, symptom, facts))


@dataclass
class CheckResult:
    exercise: str
    status: str
    diagnosis: str
    symptom: str
    hint: str
    hint_level: int
    seconds: float
    script: str
    facts: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def __repr__(self) -> str:
        return f"CheckResult(exercise={self.exercise!r}, status={self.status!r}, diagnosis={self.diagnosis!r})"

    def _ipython_display_(self) -> None:
        """A notebook shows nothing more for a result: check() has printed the report already."""

    def report(self, exercise: Exercise) -> str:
        head = f"Exercise {self.exercise} · {exercise.title} — {self.script}, {self.seconds:.1f} s"
        if self.passed:
            return f"{head}\nPASS: {self.symptom}"
        word = {"not solved": "not solved yet", "error": "error", "fail": "not yet"}[self.status]
        lines = [head, f"{word}: {self.symptom}"]
        count = len(exercise.hints_for(self.diagnosis))
        if self.hint:
            lines.append(f"Hint {self.hint_level}/{count}: {self.hint}")
        if self.status != "not solved":
            lines.append(f"(hint('{self.exercise}') for the next hint" if self.hint_level < count else
                         f"(no more hints for this; solution('{self.exercise}') shows the reference solution")
            lines[-1] += f"; the job's whole output: {self.facts['output']})" if self.facts.get("output") else ")"
        return "\n".join(lines)


class Results:
    """The results file: per exercise, the last status and how often each mistake was seen (for the hints)."""

    def __init__(self, path: str | os.PathLike | None = None, notebook: str = NOTEBOOK):
        self.path = Path(path) if path else results_file(notebook)
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.data.setdefault("exercises", {})

    def entry(self, key: str) -> dict:
        return self.data["exercises"].setdefault(key, {"checks": 0, "seen": {}, "extra_hints": {}})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)
