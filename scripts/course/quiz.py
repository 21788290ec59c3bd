"""'Check yourself': questions that start unanswered, checked from the learner's own answers and runs.

A question is two cells. The first holds the answers, each ``None`` until the learner sets it::

    NPROC = None           # how many processes?
    BATCH_PER_RANK = None  # samples per process per step

The second checks them::

    a = quiz.answers("03", NPROC=NPROC, BATCH_PER_RANK=BATCH_PER_RANK)
    if a:                                   # None while any answer is missing: the cell says which
        ...                                 # launch a run with a.NPROC, read what it wrote
        quiz.verdict(problems, "2 processes x 32 = 64, as in notebook 01")

A wrong answer gets a hint (the ``problems``, which say what to look at), never the answer. With
``COURSE_ANSWER_KEY=1`` (the tests and ``make course``) the answers come from ``answer_key/<id>.json``
instead, and a verdict that is not a pass raises, so a key that stopped passing fails the run; a pass then says
"answered from the key", as no learner predicted anything (a success text says what the run showed, never "as
you predicted": tests/test_quiz.py).
"""

import json
from pathlib import Path
from types import SimpleNamespace

from course import flag

KEYS = Path(__file__).parent / "answer_key"


def key_mode() -> bool:
    """True when COURSE_ANSWER_KEY asks every question to be answered from its key."""
    return flag("COURSE_ANSWER_KEY")


def key(question: str) -> dict:
    """The stored answers of one question (``answer_key/<question>.json``)."""
    return json.loads((KEYS / f"{question}.json").read_text())


def answers(question: str, **given):
    """The answers to check, as attributes; None (after saying which are missing) while any is still None."""
    if key_mode():
        given = {**given, **key(question)}
    missing = [name for name, value in given.items() if value is None]
    if missing:
        print(f"Not answered yet: set {', '.join(missing)} in the cell above, then run this cell again.")
        return None
    return SimpleNamespace(**given)


KEY_NOTE = "(answered from the key: COURSE_ANSWER_KEY=1)"


def verdict(problems: list[str], success: str) -> bool:
    """Print PASS and ``success`` (with KEY_NOTE when the key answered), or 'Not yet' and each problem (a hint,
    not the answer). Returns passed."""
    if problems:
        text = "Not yet: " + "; ".join(problems)
        if key_mode():
            raise AssertionError(f"the answer key does not pass: {text}")
        print(text)
        return False
    print(f"PASS: {success}" + (f" {KEY_NOTE}" if key_mode() else ""))
    return True
