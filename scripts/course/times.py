"""The course's times, from one source: ``notebooks/times.json``.

Each notebook has a learner time (minutes, an estimate), a quick-mode machine time (seconds, measured in one
``make course QUICK=1`` run, named in the file with its date and load) and a full-mode machine time (minutes,
measured or marked as an estimate). The README's table and every notebook's ``**Time:**`` line state exactly
these figures (tests/test_course_text.py holds them equal); nobody edits them by hand:

    python -m course.run_notebooks --record-times    # run the course, store its times, rewrite the text
    python -m course.times                           # rewrite the README and the headers from times.json

A Chinese header cell (first line containing 中文) states the same figures in its ``**时间：**`` line
(``header_line_zh``; the notes it adds to them are the entry's ``learner_note_zh`` and ``full_note_zh``), which
``python -m course.times`` rewrites too; ``WORDS`` holds both languages' words around the figures.
"""

import json
import os
import re
import subprocess
import sys
import time

from course import ROOT

NOTEBOOKS = ROOT / "notebooks"
TIMES = NOTEBOOKS / "times.json"
README = ROOT / "README.md"
HEADER = re.compile(r'^(\s*)("\*\*Time:\*\*(?:[^"\\]|\\.)*")(,?)$', re.MULTILINE)  # the line, as JSON in the .ipynb
HEADER_ZH = re.compile(r'^(\s*)("\*\*时间：\*\*(?:[^"\\]|\\.)*")(,?)$', re.MULTILINE)  # the Chinese header's
ROW = re.compile(r"^\| `(?P<stem>\d\d\w*)` \|.*$", re.MULTILINE)


def load() -> dict:
    return json.loads(TIMES.read_text())


def _number(x: float) -> str:
    return f"{x:g}"


# The words around the figures, per language: "" English, "_zh" Chinese (the suffix of the entry's notes in that
# language, e.g. full_note_zh). Placeholders: {learner}, {quick}, {full}, {note} (the learner note), {n} (full_min).
# The Chinese full-mode words carry their own space: 完整模式 5.1 分钟, but 完整模式约 2 分钟.
WORDS = {
    "": {"line": "**Time:** for you, about {learner} min{note} (estimate); for the machine, on 2 CPU cores: quick mode "
                 "(`COURSE_QUICK=1`) {quick} s (measured), full mode {full}.",
         "learner_note": " {}", "full_note": ", {}", "measured": "{n} min (measured{note})",
         "estimate": "about {n} min (estimate)"},
    "_zh": {"line": "**时间：** 学习约 {learner} 分钟（{note}估计）；机器用时（2 个 CPU 核）：快速模式（`COURSE_QUICK=1`）"
                    "{quick} 秒（实测），完整模式{full}。",
            "learner_note": "{}；", "full_note": "，{}", "measured": " {n} 分钟（实测{note}）", "estimate": "约 {n} 分钟（估计）"},
}


def _note(entry: dict, key: str, lang: str) -> str:
    """The entry's note in that language, in its words; a note without its translation is a KeyError."""
    return WORDS[lang][key].format(entry[key + lang]) if entry.get(key) else ""


def full_text(entry: dict, lang: str = "") -> str:
    words = WORDS[lang]
    if entry["full_measured"]:
        return words["measured"].format(n=_number(entry["full_min"]), note=_note(entry, "full_note", lang))
    return words["estimate"].format(n=_number(entry["full_min"]))


def header_line(entry: dict, lang: str = "") -> str:
    """The ``**Time:**`` line of a notebook's header; with ``lang="_zh"`` its Chinese header's ``**时间：**`` line."""
    return WORDS[lang]["line"].format(learner=entry["learner_min"], quick=entry["quick_s"], full=full_text(entry, lang),
                                      note=_note(entry, "learner_note", lang))


def header_line_zh(entry: dict) -> str:
    return header_line(entry, "_zh")


def readme_cells(entry: dict) -> list[str]:
    """The last three cells of the notebook's row in the README: learner, quick, full."""
    return [f"{entry['learner_min']} min", f"{entry['quick_s']} s", full_text(entry)]


def figures(entry: dict) -> list[str]:
    """The numbers a header in any language states: learner minutes, quick seconds, full minutes."""
    return [str(entry["learner_min"]), str(entry["quick_s"]), _number(entry["full_min"])]


def core_sentence(times: dict, core: list[str]) -> str:
    """The README's sentence under the table: the learner minutes of the core rows (path cell "core..."), 09
    counted for its core part only, as its learner time is (times.json's note on it)."""
    total = sum(times["notebooks"][stem]["learner_min"] for stem in core)
    hours = f"{total // 60} h" + (f" {total % 60} min" if total % 60 else "")
    optional = [stem[:2] for stem in core if "optional" in times["notebooks"][stem].get("learner_note", "")]
    without = f" and without the optional parts of {' and '.join(optional)}" if optional else ""
    return f"The core path adds up to about {hours} for a learner (estimate), with exercise 1 of 09 only{without}."


def readme_rows(text: str) -> dict[str, list[str]]:
    """Each notebook's row of the README's table, as cells."""
    return {m["stem"]: [cell.strip() for cell in m[0].strip("|").split("|")] for m in ROW.finditer(text)}


def _rewrite_line(raw: str, pattern: re.Pattern, render, entry: dict) -> str:
    """The notebook's JSON text with the first line that ``pattern`` finds replaced by ``render(entry)``."""

    def new_line(match):
        end = "\n" if json.loads(match[2]).endswith("\n") else ""  # the cell's last line has none
        return match[1] + json.dumps(render(entry) + end, ensure_ascii=False) + match[3]

    return pattern.sub(new_line, raw, count=1)


def apply() -> list[str]:
    """Rewrite the README's table cells and core sentence, and each notebook's Time lines (English and Chinese),
    from times.json."""
    times, changed = load(), []
    text = README.read_text()
    rows = readme_rows(text)
    for stem, cells in rows.items():
        entry = times["notebooks"][stem]
        new = "| " + " | ".join(cells[:-3] + readme_cells(entry)) + " |"
        text = text.replace("| " + " | ".join(cells) + " |", new)
    core = [stem for stem, cells in rows.items() if cells[2].startswith("core")]
    text = re.sub(r"The core path adds up to about .*?\(estimate\)[^\n]*?\.(?=\s)", core_sentence(times, core), text)
    if text != README.read_text():
        README.write_text(text)
        changed.append("README.md")
    for stem, entry in times["notebooks"].items():
        path = NOTEBOOKS / f"{stem}.ipynb"
        if not path.exists():
            continue
        raw = path.read_text()

        updated = _rewrite_line(_rewrite_line(raw, HEADER, header_line, entry), HEADER_ZH, header_line_zh, entry)
        if updated != raw:
            path.write_text(updated)
            changed.append(path.name)
    return changed


def record(results: list[tuple[str, bool, float]], quick: bool, command: str) -> str:
    """Store the machine times of a run that executed these notebooks ((file name, ok, seconds) each);
    returns the run's name in times.json. Only notebooks that ran to the end are stored."""
    times = load()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    run = f"{'quick' if quick else 'full'} {when}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    times["runs"][run] = {"command": command, "commit": commit.stdout.strip() or None, "cores": os.cpu_count(),
                          "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
                          "notebooks": sum(ok for _, ok, _ in results)}
    for name, ok, seconds in results:
        entry = times["notebooks"].get(name.removesuffix(".ipynb"))
        if not ok or entry is None:
            continue
        if quick:
            entry.update(quick_s=round(seconds), quick_run=run)
        else:
            entry.update(full_min=round(seconds / 60, 1), full_measured=True, full_run=run)
    TIMES.write_text(json.dumps(times, indent=1, ensure_ascii=False) + "\n")
    return run


if __name__ == "__main__":
    print("rewrote: " + (", ".join(apply()) or "nothing (already equal)"))
    sys.exit(0)
