"""The checker's own test set, in one place: realistic wrong solutions and correct alternatives of every exercise,
each an edit of the reference solution (or a whole script), with the diagnosis whose hints name the mistake.

    from course.exercises.mutations import CASES, by_key
    for case in CASES:
        case.key, case.name, case.expect   # expect: a diagnosis, or "pass" for a correct alternative
        case.script()                      # the script's text: the solution with case.edits applied

The benchmark (``python -m course.bench_checker``, in ``make bench``) checks every case and writes how often the
checker is wrong: false PASS (a wrong solution passes), false FAIL (a correct alternative fails) and the share of
mistakes whose first hint names them. ``Case.cls`` names the class of checker error a case guards against (issue 34), when it has one:
``false-pass``, ``false-fail``, ``averaged`` (an average where a sum belongs, or the reverse), ``crash``
(one rank's own error, its partner then reporting the closed connection), ``shape``, ``splits``,
``own-hint`` (a diagnosis that needs a hint of its own) and ``race`` (a diagnosis that must not change
from run to run).

Issue 44's kinds of mistakes whose first rung was generic or misleading are in two groups (``Case.group``):
``rungs.py``, the cases the rules that name them were written for, and ``heldout.py``, the same kinds written
before those rules and never used to write them; the benchmark reports each group's first-rung rate apart and
classes every first rung (named, generic, misleading: ``course.bench_checker``). Of these groups the tests check
only ``rungs.TESTED_RUNGS`` launched; the rest of the rung logic is tested in this process on recorded results.

The tests (``tests/test_exercises_*.py``) check the cases in ``TESTED`` and require each one's diagnosis: every
case of an exercise checked in this process; of the launched ones (a torchrun job each, about 5 s of the 2-core
box's time, which the suite's budget cannot give to all of them), every case of a class above, one correct
alternative of each exercise, and one plain mistake per diagnosis of the core path's exercises (1, 2, 6a-6c),
leaving out the debugging lab's scripts as committed, which notebook 09's headless run checks. The other correct
alternatives and the deep dives' plain mistakes (exercises 4, 5, 7, 8, 9) are the benchmark's alone.
"""

from dataclasses import dataclass

from course.exercises.results import SOLUTIONS

SCRIPT_NAMES = {"1": "ex1_convert.py", "2": "ex2_by_hand.py", "3": "ex3_sampler.py", "4": "ex4_overlap.py",
                "5": "ex5_zero1.py", "6a": "ex6a_debug.py", "6b": "ex6b_debug.py", "6c": "ex6c_debug.py",
                "7": "ex7_tp.py", "8": "ex8_pipeline.py", "9": "ex9_experts.py"}


@dataclass(frozen=True)
class Case:
    key: str  # the exercise
    name: str
    expect: str  # the diagnosis the first hint must be for; "pass" for a correct alternative
    edits: tuple = ()  # (old, new): each old text must be in the solution; replaced everywhere
    cls: str = ""  # the class of checker error it guards against (above)
    text: str | None = None  # a whole script instead of edits
    group: str = ""  # "rungs": issue 44's kinds, the rules written for them; "held-out": the same kinds, never
    #                  used to write a rule (the benchmark reports their first-rung rate apart; no test checks them)

    @property
    def correct(self) -> bool:
        return self.expect == "pass"

    @property
    def id(self) -> str:
        return f"{self.key}/{self.name}"

    def script(self) -> str:
        if self.text is not None:
            return self.text
        return mutate(self.key, *self.edits)


def mutate(key: str, *edits: tuple[str, str]) -> str:
    """The reference solution of an exercise with each (old, new) replaced; every old text must be there."""
    text = (SOLUTIONS / SCRIPT_NAMES[key]).read_text()
    for old, new in edits:
        if old not in text:
            raise ValueError(f"the solution of exercise {key} no longer contains {old!r}")
        text = text.replace(old, new)
    return text


def _cases() -> list[Case]:
    from course.exercises.mutations import core, deep, heldout, heldout55, parallel, rungs

    return [*core.CASES, *deep.CASES, *parallel.CASES, *rungs.CASES, *heldout.CASES, *heldout55.CASES]


CASES: list[Case] = _cases()
MISTAKES = [c for c in CASES if not c.correct]
ALTERNATIVES = [c for c in CASES if c.correct]
CORE_PATH = ("1", "2", "3", "6a", "6b", "6c")  # exercises of the core path (the rest belong to the deep dives)


def _tested(cases: list[Case]) -> list[Case]:
    from course.exercises import EXERCISES
    from course.exercises.mutations.rungs import TESTED_RUNGS

    named = [c for c in cases if c.id in TESTED_RUNGS]  # of issue 44's groups, a few; the rest is the benchmark's
    cases = [c for c in cases if not c.group]

    always = [c for c in cases if not EXERCISES[c.key].launches or c.cls]
    for key in dict.fromkeys(c.key for c in cases):  # a correct alternative of each exercise, the first if none has a class
        if not any(c.key == key and c.correct for c in always):
            always += [c for c in cases if c.key == key and c.correct][:1]
    diagnoses = {(c.key, c.expect) for c in always}
    for case in cases:
        if case.key in CORE_PATH and case not in always and case.name != "as committed" \
                and (case.key, case.expect) not in diagnoses:
            diagnoses.add((case.key, case.expect))
            always.append(case)
    return [c for c in cases if c in always] + named


TESTED: list[Case] = _tested(CASES)  # what the tests check (the module's docstring says why not all)


def by_key(key: str) -> list[Case]:
    return [c for c in CASES if c.key == key]


def get(case_id: str) -> Case:
    return next(c for c in CASES if c.id == case_id)
