"""The progress table: every exercise's status from the results file, as HTML in a notebook (wrapped to the
notebook's width) or as text elsewhere (wrapped at 100 columns); a result is never cut mid-line.
"""

import html
import textwrap

from course.exercises.results import Results, rel
from course.notebook import in_notebook

MARK = {"pass": "✅ pass", "fail": "❌ not yet", "error": "❌ error", "not solved": "… not solved yet",
        "not tried": "· not tried"}


def rows(exercises: list, results: Results) -> list[dict]:
    """One row per exercise: its status, how often it was checked, the first line of its last result."""
    out = []
    for ex in exercises:
        entry = results.data["exercises"].get(ex.key, {})
        out.append({"exercise": ex.key, "title": ex.title, "status": entry.get("status", "not tried"),
                    "checks": entry.get("checks", 0), "last result": entry.get("symptom", "").split("\n")[0].rstrip(":"),
                    "when": entry.get("when", "").replace("T", " ")})
    return out


def show(table: list[dict], path) -> None:
    done = sum(r["status"] == "pass" for r in table)
    title = f"{done} of {len(table)} checks pass (read from {rel(path)})"
    if not in_notebook():
        print(title)
        for r in table:
            print(f"  {r['exercise']:>3}  {r['title']:<38} {MARK[r['status']]:<18} {r['checks']:>3} checks  {r['when']}")
            if r["last result"]:
                print(textwrap.fill(r["last result"], 100, initial_indent=" " * 7, subsequent_indent=" " * 7))
        return
    from IPython.display import HTML, display

    left = "text-align:left; vertical-align:top"
    cells = "".join(
        f"<tr><td style='{left}'>{r['exercise']}</td><td style='{left}'>{html.escape(r['title'])}</td>"
        f"<td style='{left}; white-space:nowrap'>{MARK[r['status']]}</td><td style='{left}'>{r['checks']}</td>"
        f"<td style='{left}; white-space:normal; max-width:36em'>{html.escape(r['last result'])}</td>"
        f"<td style='{left}; white-space:nowrap'>{r['when']}</td></tr>" for r in table)
    display(HTML(f"<b>{html.escape(title)}</b><table style='table-layout:auto'><tr><th>#</th><th>exercise</th>"
                 f"<th>status</th><th>checks</th><th style='text-align:left'>last result</th><th>when</th></tr>"
                 f"{cells}</table>"))
