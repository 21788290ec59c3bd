"""The diff between two course scripts, and a check that every changed hunk is marked as a lesson step.

    d = script_diff("train_single.py", "train_ddp.py", marker=r"DDP step (\\d)")
    d.show()               # the unified diff, rendered in the notebook
    d.steps                # {1, 2, 3, 4, 5}: the step numbers found in the changed hunks
    d.unmarked             # hunks that change more than imports and carry no marker: should be []
"""

import ast
import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from course import SCRIPTS, in_repo


@dataclass
class ScriptDiff:
    before: str
    after: str
    lines: list[str]
    hunks: list[str]
    steps: set[int]
    unmarked: list[str]

    @property
    def added(self) -> int:
        return sum(line.startswith("+") and not line.startswith("+++") for line in self.lines)

    @property
    def removed(self) -> int:
        return sum(line.startswith("-") and not line.startswith("---") for line in self.lines)

    def text(self) -> str:
        return "\n".join(self.lines)

    def show(self) -> None:
        """Render the diff as a highlighted block in a notebook (plain text elsewhere)."""
        try:
            from IPython.display import Markdown, display
        except ImportError:
            print(self.text())
            return
        display(Markdown("```diff\n" + self.text() + "\n```"))

    def summary(self) -> str:
        return (f"{self.before} -> {self.after}: {self.added} lines added, {self.removed} removed; "
                f"steps marked: {sorted(self.steps)}; unmarked non-import hunks: {len(self.unmarked)}")


def _path(name: str | Path) -> Path:
    path = in_repo(name)
    return path if path.exists() else SCRIPTS / name


def _import_lines(lines: list[str]) -> set[int]:
    """The 1-based numbers of the lines that belong to an import statement (a parenthesized one spans several)."""
    tree = ast.parse("\n".join(lines))
    return {n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for n in range(node.lineno, node.end_lineno + 1)}


def _hunks(diff: list[str], imports_a: set[int], imports_b: set[int]) -> list[tuple[str, bool]]:
    """(text, changes only imports) for each hunk of a unified diff (headers ``---``/``+++`` skipped)."""
    hunks = []
    for line in diff[2:]:
        if line.startswith("@@"):
            old, new = (int(part.split(",")[0]) for part in re.findall(r"[-+](\d+(?:,\d+)?)", line)[:2])
            hunks.append([[line], True, old, new])
            continue
        hunk = hunks[-1]
        hunk[0].append(line)
        if line.startswith("-"):
            hunk[1] &= hunk[2] in imports_a
            hunk[2] += 1
        elif line.startswith("+"):
            hunk[1] &= hunk[3] in imports_b
            hunk[3] += 1
        else:
            hunk[2] += 1
            hunk[3] += 1
    return [("\n".join(text), only_imports) for text, only_imports, _, _ in hunks]


def _body(lines: list[str]) -> list[str]:
    """The script without its header (leading comments and module docstring), which always differs."""
    i = 0
    while i < len(lines) and (lines[i].startswith("#") or not lines[i].strip()):
        i += 1
    if i < len(lines) and lines[i].lstrip().startswith('"""'):
        if lines[i].count('"""') >= 2:
            return lines[i + 1:]
        i += 1
        while i < len(lines) and '"""' not in lines[i]:
            i += 1
        return lines[i + 1:]
    return lines[i:]


def script_diff(before: str | Path, after: str | Path, marker: str = r"DDP step (\d)", context: int = 1) -> ScriptDiff:
    """Diff two scripts (names under scripts/ or paths); ``marker`` is a regex whose group 1 is the step."""
    a, b = _path(before), _path(after)
    lines = list(difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), a.name, b.name,
                                      lineterm="", n=context))
    # Markers are checked in the code below the header; the header (what the script is) always changes.
    body_a, body_b = _body(a.read_text().splitlines()), _body(b.read_text().splitlines())
    body = list(difflib.unified_diff(body_a, body_b, lineterm="", n=context))
    hunks = _hunks(body, _import_lines(body_a), _import_lines(body_b))
    pattern = re.compile(marker)
    steps = {int(m.group(1)) for hunk, _ in hunks for m in pattern.finditer(hunk) if m.groups()}
    unmarked = [hunk for hunk, only_imports in hunks if not pattern.search(hunk) and not only_imports]
    hunks = [hunk for hunk, _ in hunks]
    return ScriptDiff(a.name, b.name, lines, hunks, steps, unmarked)
