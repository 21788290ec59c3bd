"""The README and the documentation pages (docs/): a landing page a learner reads in minutes, pages whose links
resolve, figures of ``make bench`` that no one copied by hand, and tables that say what the code does.

- **Bench blocks** (``course.bench_report``): every ``<!-- bench:NAME -->`` block of README.md and docs/*.md equals
  its rendering of docs/benchmarks.json, and each entry of that file equals what the extractor takes from its
  benchmark's metrics.json wherever that file is present (after ``make bench``); in a fresh clone, an entry is
  null (its blocks say "not measured") or carries the extractor's fields with the machine, date and commit.
- **Bad input**: docs/troubleshooting.md's table of script groups x checks is derived here from each script's own
  source (its argparse types, its calls), cell by cell, and covers every script it should.
- **What the doctor finds**: docs/doctor.md names every finding code the doctor has (``report.LESSONS``).
"""

import ast
import json
import re
import shutil
from pathlib import Path

import pytest

from course import ROOT, SCRIPTS, bench_report

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STAMP = {"date", "machine", "commit"}


# ----------------------------------------------------------------------------------------- the landing page

def test_the_readme_is_a_landing_page_in_its_order():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 155, "README.md is a landing page (about 150 lines): the rest goes to docs/"
    assert re.findall(r"^## (.+)$", text, re.MULTILINE) == [
        "Start", "The notebooks", "The hardware it runs on", "Check your own script: the DDP doctor",
        "When something goes wrong", "Layout", "中文简介"]
    for command in ("make course", "make test", "make lab", "make doctor-wheel", "pip install build/dist/*.whl",
                    "ddp-doctor your_script.py"):
        assert command in text, command
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", text))
    assert linked == {f"docs/{p.name}" for p in DOCS.glob("*.md")}, "the README links every documentation page"


def test_no_page_carries_issue_numbers_internal_names_or_history():
    pattern = re.compile(r"\bissues? \d+|\bEX\d_[A-Z]|\bCase\.\w|\bhints\.[A-Z]|mutations\.TESTED|--group held-out|"
                         r"\b[Uu]ntil 20\d\d|\b(?:now|no longer) (?:gets?|names?)\b", re.IGNORECASE)
    found = {p.name: pattern.findall(p.read_text()) for p in PAGES}
    assert not {k: v for k, v in found.items() if v}, found


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lower case, punctuation dropped, spaces as hyphens)."""
    text = path.read_text()
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return ({re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            | set(re.findall(r'<a id="([^"]+)"></a>', text)))  # and explicit anchors (the glossary's)


def _links(path: Path) -> list[tuple[str, str]]:
    text = path.read_text() if path.suffix == ".md" else "\n".join(
        "".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    return re.findall(r"\]\((?!https?://)([^)#\s]*)(?:#([\w-]+))?\)", text)


@pytest.mark.parametrize("path", [*PAGES, *NOTEBOOKS], ids=lambda p: p.name)
def test_every_local_link_and_anchor_resolves(path):
    wrong = []
    for target, anchor in _links(path):
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            wrong.append(f"{target}#{anchor}: no such heading")
    assert not wrong, wrong


# ------------------------------------------------------------------------------------ figures of make bench

def test_every_bench_block_is_rendered_from_benchmarks_json():
    figures = bench_report.load()
    assert set(figures) == {"about", *bench_report.EXTRACT}, "docs/benchmarks.json: one entry per benchmark"
    names = [name for page in PAGES for name in bench_report.blocks(page.read_text())]
    assert sorted(names) == sorted(bench_report.RENDER), "each block once, none unknown"
    stale = [p.name for p in PAGES if bench_report.rendered(p.read_text(), figures) != p.read_text()]
    assert not stale, f"bench blocks not rendered from docs/benchmarks.json (python -m course.bench_report): {stale}"


@pytest.mark.parametrize("name", list(bench_report.EXTRACT))
def test_each_entry_is_its_benchmarks_metrics_or_has_the_extractors_fields(name):
    entry = bench_report.load()[name]
    path = bench_report.metrics_path(name)
    if path.exists():  # after make bench: the committed figures are this run's
        assert entry is not None, f"{path} exists but docs/benchmarks.json has no {name} entry (course.bench_report)"
        fields = {k: v for k, v in entry.items() if k not in STAMP}
        assert fields == bench_report.EXTRACT[name](json.loads(path.read_text())), (
            f"docs/benchmarks.json's {name} is not what {path} holds: python -m course.bench_report")
        assert entry["date"] == bench_report.written(path)
    elif entry is not None:  # a fresh clone: the committed figures, in the extractor's shape, with their origin
        expected = set(bench_report.EXTRACT[name](SYNTHETIC[name]())) | STAMP
        assert set(entry) == expected and all(entry[k] for k in ("date", "machine")), (name, sorted(entry))


def _verdict(head: str, word: str) -> str:
    return f"{head}: 1.20x (1.10-1.30) the wall time of plain - {word}"


SYNTHETIC = {  # the fields each benchmark writes (course.bench_*), with made-up numbers
    "launcher": lambda: {"values": {"bare torchrun": [3.0] * 5, "course launcher": [3.1] * 5},
                         "median": {"bare torchrun": 3.04, "course launcher": 3.12},
                         "verdict": "course launcher: 1.03x (1.01-1.05) the wall time of bare torchrun - about the same "
                                    "(every one of 5 rounds within 5%)"},
    "noise": lambda: {"rounds": 5, "comparisons": [{}] * 20, "factor": 10, "large_counts": {"slower": 5, "of": 5},
                      "counts": {"above": 0, "below": 0, "same": 6, "noisy": 14, "faster_or_slower": 0}},
    "checker": lambda: {"mistakes": 92, "correct_alternatives": 24, "false_pass": 0, "false_fail": 1,
                        "first_hint_names_mistake": 90, "first_rung": {"named": 90, "generic": 1, "misleading": 1,
                                                                       "passed": 0},
                        "per_group": {"older": {"mistakes": 70, "first_hint_names_mistake": 70,
                                                "first_rung": {"named": 70, "generic": 0, "misleading": 0, "passed": 0}},
                                      "held-out": {"mistakes": 22, "first_hint_names_mistake": 20,
                                                   "first_rung": {"named": 20, "generic": 1, "misleading": 1,
                                                                  "passed": 0}}},
                        "jobs": 2, "repeat": 1, "unstable_cases": [], "check_seconds_median": 12.9,
                        "check_seconds_max": 26.0, "processes_left": 0},
    "doctor": lambda: {"accuracy": {"cases": 62, "expected_findings": 31, "found": 30, "false_alarms": 1,
                                    "clean_cases": 34},
                       "overhead": {s: {"values": {"doctor": [1.0] * 5}, "ratio": r,
                                        "verdict_whole": _verdict("doctor", "too noisy to tell: 2 of 5 rounds above")}
                                    for s, r in (("a/startup_only.py", 0.99), ("scripts/train_ddp.py", 1.08))},
                       "cost_by_length": [{"script": "a/startup_only.py", "plain_s": 3.8, "added_s": 1.2,
                                           "doctor_over_plain": 1.31},
                                          {"script": "scripts/train_ddp.py", "plain_s": 7.0, "added_s": 1.8,
                                           "doctor_over_plain": 1.26}], "goal_ratio": 1.2},
    "doctor_public": lambda: {"accuracy": {"cases": 20, "expected_findings": 10, "found": 10, "false_alarms": 0,
                                           "clean_cases": 10},
                              "timing": {"a": {"values": {"doctor": [1.0] * 5}, "ratio": 0.78},
                                         "b": {"values": {"doctor": [1.0] * 5}, "ratio": 1.24},
                                         "c": {"error": "the plain run failed"}},
                              "summary": {"median_doctor_s": 12.0, "max_doctor_s": 17.0, "median_ratio": 1.17}},
}


def test_a_bench_run_goes_into_the_json_and_the_pages_from_its_numbers(tmp_path, monkeypatch):
    """collect() then apply() on copies: each block states the run's own figures, with the machine and the date;
    a benchmark not run says so."""
    bench, docs = tmp_path / "runs" / "benchmarks", tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    (docs / "benchmarks.json").unlink()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.setattr(bench_report, "ROOT", tmp_path)
    monkeypatch.setattr(bench_report, "BENCH", bench)
    monkeypatch.setattr(bench_report, "DOCS", docs)
    monkeypatch.setattr(bench_report, "FIGURES", docs / "benchmarks.json")
    for name in ("checker", "doctor", "doctor_public"):  # the launcher and the noise benchmarks not run
        path = bench / bench_report.SOURCES[name] / "metrics.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(SYNTHETIC[name]()))
    assert bench_report.collect() == ["checker", "doctor", "doctor_public"]
    changed = set(bench_report.apply())  # benchmarks.md too when the committed figures had launcher/noise runs
    assert {"README.md", "docs/checker.md", "docs/doctor.md"} <= changed <= {"README.md", "docs/benchmarks.md",
                                                                            "docs/checker.md", "docs/doctor.md"}
    assert bench_report.apply() == []
    figures = bench_report.load()
    assert figures["launcher"] is None and figures["doctor"]["found"] == 30 and figures["doctor"]["codes"] > 20
    blocks = {name: body for page in [tmp_path / "README.md", *docs.glob("*.md")]
              for name, body in bench_report.blocks(page.read_text()).items()}
    assert blocks["launcher"].strip() == blocks["noise"].strip() == bench_report.NOT_RUN
    when = f"{figures['doctor']['machine']}, {figures['doctor']['date']}"
    assert "30 of 31 expected findings made; false alarms: 1 in 62 cases (34 of them" in blocks["doctor-accuracy"]
    assert when in blocks["doctor-accuracy"] and "10 of 10 mistakes named" in blocks["doctor-accuracy"]
    assert "| `startup_only.py` | 3.8 s | 1.31x | +1.2 s | 5 | too noisy to tell |" in blocks["doctor-cost"]
    assert "0.99x to 1.08x (goal: at most 1.20x)" in blocks["doctor-cost"]
    assert "took 1.17x the plain run's wall time (median; 0.78x to 1.24x): on some it took less" in blocks["doctor-cost"]
    assert "On its own test set of 62 scripts, the last `make bench` found 30 of 31" in blocks["readme-doctor"]
    assert "0 false PASS, 1 false FAIL" in blocks["checker"]
    assert "90 of 92 (1 generic, 1 misleading)" in blocks["checker"] and "held-out" not in blocks["checker"]


def test_fewer_rounds_than_the_rule_needs_give_no_faster_or_slower_sentence():
    public = {**{k: 1 for k in ("cases", "clean_cases", "expected", "found", "false_alarms", "median_s", "max_s")},
              "timed": 1, "rounds": 1, "ratio_median": 0.8, "ratio_low": 0.8, "ratio_high": 0.8,
              "date": "d", "machine": "m", "commit": "c"}
    own = {"cost": [], "recorder_low": 1.0, "recorder_high": 1.0, "goal": 1.2, "date": "d", "machine": "m",
           "commit": "c"}
    text = bench_report.doctor_cost({"doctor": own, "doctor_public": public})
    assert "1 round(s) each are too few to say which is faster" in text and "less time" not in text
    assert "less time" in bench_report.doctor_cost({"doctor": own, "doctor_public": {**public, "rounds": 5}})


def test_a_block_whose_text_was_edited_by_hand_is_found():
    figures = {name: None for name in bench_report.EXTRACT}
    page = "x\n<!-- bench:launcher -->\nbare torchrun 3.0 s, the launcher 3.1 s\n<!-- /bench:launcher -->\ny\n"
    assert bench_report.rendered(page, figures) != page
    assert bench_report.rendered(bench_report.rendered(page, figures), figures) == bench_report.rendered(page, figures)
    with pytest.raises(KeyError):
        bench_report.rendered("<!-- bench:nothing -->\n<!-- /bench:nothing -->", figures)


# --------------------------------------------------------------------------------- what the doctor finds

def test_the_checkers_held_out_judgments_cover_the_set_and_the_page_says_their_counts():
    """docs/checker-held-out.json judges the first hint of every case of the held-out set checked once (names,
    generic, misleading); docs/checker.md's block gives its counts, per exercise, as this test renders them."""
    from collections import Counter

    from course.exercises.mutations.heldout55 import CASES as HELD_OUT

    cases = json.loads((DOCS / "checker-held-out.json").read_text())["cases"]
    assert sorted(c["case"] for c in cases) == sorted(c.id for c in HELD_OUT)
    assert {c["judged"] for c in cases} <= {"names", "generic", "misleading"} and all(c["why"] for c in cases)
    assert all(c["status"] != "pass" and c["first_hint"] for c in cases), "every held-out mistake failed, with a hint"
    total, per = Counter(c["judged"] for c in cases), {}
    for c in cases:
        per.setdefault(c["exercise"], []).append(c["judged"])
    shown = "; ".join(f"{ex}: {js.count('names')} of {len(js)}" + (f" ({js.count('misleading')} misleading)"
                                                                   if "misleading" in js else "") for ex, js in per.items())
    text = (f"The first hint names the mistake for {total['names']} of {len(cases)} "
            f"({100 * total['names'] / len(cases):.0f} %), is generic for {total['generic']} and misleading for "
            f"{total['misleading']}; by exercise: {shown}. Misleading: "
            + ", ".join(f"`{c['case']}`" for c in cases if c["judged"] == "misleading") + ".")
    page = (DOCS / "checker.md").read_text()
    assert f"<!-- held-out:judged -->\n{text}\n<!-- /held-out:judged -->" in page, text


def test_the_doctor_page_names_every_finding_it_has():
    from ddp_doctor.report import LESSONS

    text = (DOCS / "doctor.md").read_text()
    section = text[text.index("## What it finds"):text.index("## What it cannot see")]
    codes = set(re.findall(r"\(`([a-z-]+)`[,:)]", section)) | set(re.findall(r", `([a-z-]+)`\)", section))
    assert codes == set(LESSONS), (sorted(set(LESSONS) - codes), sorted(codes - set(LESSONS)))


# ------------------------------------------------------------------------------------------- bad input

SIZE_FLAGS = ("--n-layer", "--n-embd", "--width", "--tokens")
CELLS = {  # the table's words for each derived value, column by column
    "seed": {"yes": "refused", "none": "no `--seed`", "no": "not checked"},
    "size": {"yes": "refused", "none": "no size flag", "no": "not checked"},
    "outputs": {"probed": "probed with a file", "made": "created now", "no": "not checked"},
    "busy": {"yes": "refused", "no": "not checked"},
    "prints": {"rank 0": "rank 0 only", "every rank": "every rank"},
}


def _arguments(tree) -> dict[str, str | None]:
    """{flag: the name of its argparse type (a function, or the function that makes it)}."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant):
            kind = next((k.value for k in node.keywords if k.arg == "type"), None)
            found[node.args[0].value] = (kind.id if isinstance(kind, ast.Name) else
                                         kind.func.id if isinstance(kind, ast.Call) else None)
    return found


def checks(script: str) -> dict[str, str]:
    """What ``script`` checks before any process group, read from its source: its --seed's type, a memory check
    (course.args.check_size / check_gpt_size), its output paths (probed by course.args' types or
    course.train_utils' checks, or created with parser.error on failure), a busy --run-dir (JobParser's look,
    course.runlog or course.rundir's claim), and who prints the error (JobParser: rank 0; argparse: every rank)."""
    tree = ast.parse((SCRIPTS / script).read_text())
    args = _arguments(tree)
    called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    job = "JobParser" in called
    probed = names & {"output_dir", "writable_file", "repo_output_dir", "repo_writable_file"} or \
        called & {"check_writable", "check_folder"}
    return {"seed": "none" if "--seed" not in args else "yes" if args["--seed"] in ("seed", "lm_seed", "whole") else "no",
            "size": "yes" if called & {"check_size", "check_gpt_size"} else
            "no" if set(args) & set(SIZE_FLAGS) else "none",
            "outputs": "probed" if probed else "made" if {"mkdir", "error"} <= called else "no",
            "busy": "yes" if called & {"claim_run_dir", "RunLog"} or (job and "--run-dir" in args) else "no",
            "prints": "rank 0" if job else "every rank"}


def in_scope() -> set[str]:
    """The take-home scripts, and every script that parses its flags with JobParser and checks its --run-dir."""
    from test_takeaway import TAKE_HOME

    jobs = {p.name for p in SCRIPTS.glob("*.py") if "JobParser(" in p.read_text()
            and _arguments(ast.parse(p.read_text())).get("--run-dir") in ("output_dir", "repo_output_dir")}
    return set(TAKE_HOME) | jobs


def bad_input_table() -> list[tuple[list[str], list[str]]]:
    """docs/troubleshooting.md's table: (the scripts of a row, its check cells in CELLS' order)."""
    text = (DOCS / "troubleshooting.md").read_text()
    section = text[text.index("## Bad input"):]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    return [(re.findall(r"`([\w.]+\.py)`", cells[0]), [c.strip() for c in cells[2:]]) for cells in rows]


def test_the_bad_input_table_says_what_each_script_checks():
    table = bad_input_table()
    listed = [s for scripts, _ in table for s in scripts]
    assert sorted(listed) == sorted(in_scope()), "each script in scope in exactly one row"
    wrong = {}
    for scripts, cells in table:
        assert len(cells) == len(CELLS), cells
        for script in scripts:
            derived = [CELLS[column][value] for column, value in checks(script).items()]
            if derived != cells:
                wrong[script] = {c: (said, real) for c, said, real in zip(CELLS, cells, derived, strict=True)
                                 if said != real}
    assert not wrong, f"docs/troubleshooting.md's bad-input table vs the scripts (said, derived): {wrong}"


def test_the_derivation_tells_the_checks_apart():
    assert checks("train_lm.py") == {"seed": "yes", "size": "yes", "outputs": "probed", "busy": "yes",
                                     "prints": "rank 0"}
    assert checks("train_ddp.py") == {"seed": "yes", "size": "none", "outputs": "made", "busy": "no",
                                      "prints": "every rank"}
    assert checks("shard_memory.py")["seed"] == "none" and checks("moe_layer.py")["size"] == "yes"
    assert checks("train_flowers.py")["outputs"] == "probed" and checks("dcp_reshape.py")["size"] == "none"
