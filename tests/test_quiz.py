"""'Check yourself' starts unanswered in every notebook, and course.quiz says so instead of passing."""

import ast
import re

import nbformat
import pytest

from course import ROOT, quiz

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CALL = re.compile(r"quiz\.answers\(\s*\"([^\"]+)\"((?:[^()]|\([^()]*\))*)\)", re.DOTALL)


def questions(path) -> list[tuple[str, list[str]]]:
    """(question id, answer names) of each quiz.answers(...) call in a notebook."""
    found = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            for qid, rest in CALL.findall(cell.source):
                found.append((qid, re.findall(r"(\w+)\s*=", rest)))
    return found


def assigned_none(path) -> set[str]:
    """Names that a code cell of the notebook sets to None at the top level (``NAME = None``)."""
    names = set()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code" or cell.source.lstrip().startswith(("%%", "!")):
            continue
        try:
            tree = ast.parse("\n".join(line for line in cell.source.splitlines() if not line.startswith(("%", "!"))))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is None:
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_check_yourself_starts_unanswered(path):
    text = path.read_text()
    if "Check yourself" not in text:
        pytest.skip(f"{path.name} has no Check yourself")
    asked = questions(path)
    assert asked or "quiz.verdict" in text, f"{path.name}: its Check yourself does not go through course.quiz"
    unanswered = assigned_none(path)
    for qid, names in asked:
        assert names, f"{path.name}: quiz.answers({qid!r}) checks no answer"
        assert set(names) <= unanswered, f"{path.name}: {sorted(set(names) - unanswered)} do not start as None"
        assert set(names) <= set(quiz.key(qid)), f"answer_key/{qid}.json lacks {sorted(set(names) - set(quiz.key(qid)))}"


def test_an_unanswered_question_does_not_pass(monkeypatch, capsys):
    monkeypatch.delenv("COURSE_ANSWER_KEY", raising=False)
    assert quiz.answers("03", STEPS_PER_EPOCH=None, BATCH_PER_RANK=16) is None
    assert "Not answered yet: set STEPS_PER_EPOCH" in capsys.readouterr().out
    assert quiz.verdict(["the run used 1 process"], "never printed") is False
    assert "Not yet: the run used 1 process" in capsys.readouterr().out


def test_the_key_answers_and_a_failing_key_raises(monkeypatch):
    monkeypatch.setenv("COURSE_ANSWER_KEY", "1")
    got = quiz.answers("03", BATCH_PER_RANK=None, STEPS_PER_EPOCH=None)
    assert got is not None and vars(got) == quiz.key("03")
    with pytest.raises(AssertionError, match="does not pass"):
        quiz.verdict(["wrong"], "x")


def test_no_answer_of_check_yourself_is_written_in_the_notebook_before_it():
    """Learner review O20: 03's comment "938 is one epoch of 60 000 samples" gave away the second answer. No number
    of 3 digits or more from a question's key is written in the prose or a code comment above the question."""
    leaks = []
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        for qid, _ in questions(path):
            first = next(i for i, c in enumerate(cells) if f'quiz.answers("{qid}"' in c.source)
            above = "\n".join(c.source if c.cell_type == "markdown" else "\n".join(re.findall(r"#.*", c.source))
                              for c in cells[:first - 1] if "Check yourself" not in c.source)
            numbers = {str(v) for v in quiz.key(qid).values() if isinstance(v, int) and not isinstance(v, bool)
                       and v >= 100}
            leaks += [f"{path.name}: {n} ({qid})" for n in numbers if re.search(rf"(?<![\d.]){n}(?![\d.])", above)]
    assert not leaks, leaks


def test_a_pass_from_the_key_says_so(monkeypatch, capsys):
    """Issue 52: executed copies said "PASS ... as you predicted" under PREDICTED_SUM = None. From the key a pass
    says it was answered from the key; a learner's pass does not."""
    monkeypatch.setenv("COURSE_ANSWER_KEY", "1")
    assert quiz.verdict([], "3 ranks, every one holds 6 = 1 + 2 + 3.") is True
    assert capsys.readouterr().out.strip() == f"PASS: 3 ranks, every one holds 6 = 1 + 2 + 3. {quiz.KEY_NOTE}"
    assert "answered from the key" in quiz.KEY_NOTE
    monkeypatch.delenv("COURSE_ANSWER_KEY")
    assert quiz.verdict([], "x") is True
    assert capsys.readouterr().out == "PASS: x\n"


def test_no_check_yourself_claims_the_learner_predicted_it():
    """A success text says what the run showed; whether a learner or the key answered is quiz.verdict's to say."""
    claims = [f"{path.name}: {line.strip()}" for path in NOTEBOOKS for cell in nbformat.read(path, as_version=4).cells
              if cell.cell_type == "code" and "quiz." in cell.source
              for line in cell.source.splitlines() if re.search(r"\byou (predicted|answered|guessed)", line)]
    assert not claims, claims
