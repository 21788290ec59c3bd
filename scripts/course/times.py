"""The course's times, from one source: ``notebooks/times.json``.

Each notebook has a learner time (minutes, an estimate), a quick-mode machine time (seconds, measured in one
``make course QUICK=1`` run, named in the file with its date and load) and a full-mode machine time (minutes,
measured or marked as an estimate). The README's table and every notebook's ``**Time:**`` line state exactly
these figures (tests/test_course_text.py holds them equal); nobody edits them by hand:

    python -m course.run_notebooks --record-times    # run the course, store its times, rewrite the text
    python -m course.times                           # rewrite the README and the headers from times.json

A Chinese header cell (first line containing 中文) states the same figures in a line starting ``**时间``.
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
ROW = re.compile(r"^\| `(?P<stem>\d\d\w*)` \|.*$", re.MULTILINE)


def load() -> dict:
    return json.loads(TIMES.read_text())


def _number(x: float) -> str:
    return f"{x:g}"


def full_text(entry: dict) -> str:
    if entry["full_measured"]:
        note = f", {entry['full_note']}" if entry.get("full_note") else ""
        return f"{_number(entry['full_min'])} min (measured{note})"
    return f"about {_number(entry['full_min'])} min (estimate)"


def header_line(entry: dict) -> str:
    """The ``**Time:**`` line of a notebook's header."""
    note = f" {entry['learner_note']}" if entry.get("learner_note") else ""
    return (f"**Time:** for you, about {entry['learner_min']} min{note} (estimate); for the machine, on 2 CPU "
            f"cores: quick mode (`COURSE_QUICK=1`) {entry['quick_s']} s (measured), full mode {full_text(entry)}.")


def readme_cells(entry: dict) -> list[str]:
    """The last three cells of the notebook's row in the README: learner, quick, full."""
    return [f"{entry['learner_min']} min", f"{entry['quick_s']} s", full_text(entry)]


def figures(entry: dict) -> list[str]:
    """The numbers a header in any language states: learner minutes, quick seconds, full minutes."""
    return [str(entry["learner_min"]), str(entry["quick_s"]), _number(entry["full_min"])]


def core_sentence(times: dict, core: list[str]) -> str:
    total = sum(times["notebooks"][stem]["learner_min"] for stem in core)
    return (f"The core path adds up to about {total // 60} h {total % 60} min for a learner (estimate), "
            "09's three core exercises included.")


def readme_rows(text: str) -> dict[str, list[str]]:
    """Each notebook's row of the README's table, as cells."""
    return {m["stem"]: [cell.strip() for cell in m[0].strip("|").split("|")] for m in ROW.finditer(text)}


def apply() -> list[str]:
    """Rewrite the README's table cells and core sentence, and each notebook's Time line, from times.json."""
    times, changed = load(), []
    text = README.read_text()
    rows = readme_rows(text)
    for stem, cells in rows.items():
        entry = times["notebooks"][stem]
        new = "| " + " | ".join(cells[:-3] + readme_cells(entry)) + " |"
        text = text.replace("| " + " | ".join(cells) + " |", new)
    core = [stem for stem, cells in rows.items() if cells[2].startswith("core")]
    text = re.sub(r"The core path adds up to about .*?included\.", core_sentence(times, core), text)
    if text != README.read_text():
        README.write_text(text)
        changed.append("README.md")
    for stem, entry in times["notebooks"].items():
        path = NOTEBOOKS / f"{stem}.ipynb"
        if not path.exists():
            continue
        raw = path.read_text()

        def new_line(match, entry=entry):
            end = "\n" if json.loads(match[2]).endswith("\n") else ""  # the cell's last line has none
            return match[1] + json.dumps(header_line(entry) + end, ensure_ascii=False) + match[3]

        updated = HEADER.sub(new_line, raw, count=1)
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
