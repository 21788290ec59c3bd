"""The course's text: readable in a sitting, and its times from one source.

- The markdown of notebooks 00-09 (04b included) holds at most 22,000 words, counted by splitting on whitespace
  (issue 19: say each thing once, link to the glossary after). A cell whose first line contains 中文 is a Chinese
  rendering of another cell and is not counted.
- Times (issue 33 §2): the README's table and every notebook's ``**Time:**`` line state exactly the figures of
  ``notebooks/times.json`` (course.times), and a Chinese header's ``**时间`` line states the same numbers.
"""

import re

import nbformat

from course import ROOT, times

LIMIT = 22_000
CHINESE = "中文"


def is_chinese(cell) -> bool:
    return CHINESE in cell.source.split("\n", 1)[0]


def markdown_words(path) -> int:
    return sum(len(cell.source.split()) for cell in nbformat.read(path, as_version=4).cells
               if cell.cell_type == "markdown" and not is_chinese(cell))


def test_markdown_of_notebooks_00_to_09_stays_under_the_word_limit():
    paths = sorted(p for p in (ROOT / "notebooks").glob("0[0-9]*.ipynb"))
    assert [p.name[:2] for p in paths][:2] == ["00", "01"] and paths[-1].name.startswith("09")
    counts = {p.name: markdown_words(p) for p in paths}
    total = sum(counts.values())
    print(f"markdown words in notebooks 00-09: {total} (limit {LIMIT}); "
          + ", ".join(f"{name[:3].rstrip('_')} {n}" for name, n in counts.items()))
    assert total <= LIMIT, f"{total} words of markdown in notebooks 00-09, more than {LIMIT}: {counts}"


def test_chinese_cells_are_not_counted(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("one two three"),
                                         nbformat.v4.new_markdown_cell(f"{CHINESE}\n一 二 三 四 five six"),
                                         nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(nb, tmp_path / "x.ipynb")
    assert markdown_words(tmp_path / "x.ipynb") == 3


def test_times_in_the_readme_and_every_header_are_those_of_times_json():
    data = times.load()
    stems = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(data["notebooks"]) == stems, "every notebook has its times in notebooks/times.json"
    for stem, entry in data["notebooks"].items():
        assert entry["quick_run"] in data["runs"], f"{stem}: the run its quick time comes from is described"
    readme = times.README.read_text()
    rows = times.readme_rows(readme)
    assert sorted(rows) == stems, "every notebook has a row in the README's table"
    wrong = {stem: cells[-3:] for stem, cells in rows.items() if cells[-3:] != times.readme_cells(data["notebooks"][stem])}
    assert not wrong, f"README cells that differ from notebooks/times.json (python -m course.times rewrites them): {wrong}"
    core = [stem for stem, cells in rows.items() if cells[2].startswith("core")]
    assert times.core_sentence(data, core) in readme
    for stem in stems:
        entry = data["notebooks"][stem]
        cells = [c for c in nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4).cells
                 if c.cell_type == "markdown"]
        lines = [line for line in cells[0].source.splitlines() if line.startswith("**Time:**")]
        assert lines == [times.header_line(entry)], f"{stem}: its header's Time line is not times.json's"
        for cell in filter(is_chinese, cells):
            for line in (line for line in cell.source.splitlines() if line.startswith("**时间")):
                numbers = re.findall(r"\d+(?:\.\d+)?", line)
                assert all(figure in numbers for figure in times.figures(entry)), (stem, line, times.figures(entry))


def test_a_recorded_run_rewrites_the_readme_and_the_headers(tmp_path, monkeypatch):
    """``course.run_notebooks --record-times``: the run's seconds go into times.json, then into the text."""
    import shutil

    for name in ("times.json", "00_environment.ipynb"):
        shutil.copy(ROOT / "notebooks" / name, tmp_path / name)
    shutil.copy(times.README, tmp_path / "README.md")
    monkeypatch.setattr(times, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(times, "TIMES", tmp_path / "times.json")
    monkeypatch.setattr(times, "README", tmp_path / "README.md")
    before = times.load()["notebooks"]["01_single_device"]
    run = times.record([("00_environment.ipynb", True, 21.4), ("01_single_device.ipynb", False, 3.0)],
                       quick=True, command="COURSE_QUICK=1 python -m course.run_notebooks 00 01")
    data = times.load()
    assert data["notebooks"]["00_environment"]["quick_s"] == 21 and data["notebooks"]["00_environment"]["quick_run"] == run
    assert data["notebooks"]["01_single_device"] == before  # it failed: its time is not stored
    assert data["runs"][run]["notebooks"] == 1 and len(data["runs"][run]["load_average_at_end"]) == 3
    assert sorted(times.apply()) == ["00_environment.ipynb", "README.md"]
    assert times.readme_rows((tmp_path / "README.md").read_text())["00_environment"][-2] == "21 s"
    header = nbformat.read(tmp_path / "00_environment.ipynb", as_version=4).cells[0].source
    assert times.header_line(data["notebooks"]["00_environment"]) in header and " 21 s (measured)" in header
    assert times.apply() == []  # equal now


def test_notebook_01s_bad_input_demo_prints_exit_status_2_from_a_path_with_a_space(tmp_path, monkeypatch):
    """Learner review N6: ``!{sys.executable} ...`` split the interpreter's path at a space (exit status 127).
    The cell runs here with an interpreter whose path has a space, from notebooks/ as the kernel does."""
    import contextlib
    import io
    import os
    import sys
    from types import SimpleNamespace

    cell = next(c.source for c in nbformat.read(ROOT / "notebooks" / "01_single_device.ipynb", as_version=4).cells
                if c.cell_type == "code" and "exit status" in c.source)
    python = tmp_path / "a folder" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.chdir(ROOT / "notebooks")
    monkeypatch.setitem(os.environ, "OMP_NUM_THREADS", "1")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(cell, "01 cell", "exec"), {"sys": SimpleNamespace(executable=str(python))})  # noqa: S102
    assert out.getvalue().count("exit status 2") == 2, out.getvalue()


def _run_03_speed_cell(samples_per_s, cores=2, gpus=0, quick=False):
    """Notebook 03's speed cell, executed with its launches replaced by rounds that return the given samples/s
    (each configuration's list, one value per round): what it prints."""
    import contextlib
    import io

    from course.measure import compare

    cells = nbformat.read(ROOT / "notebooks" / "03_ddp_five_steps.ipynb", as_version=4).cells
    source = next(c.source for c in cells if c.cell_type == "code" and "speed = Rounds(" in c.source)

    class Rounds:  # what course.rounds.Rounds does, without launching: each round takes the next value
        def __init__(self, root):
            self.labels = []

        def add(self, label, script, args, **options):
            assert script == "train_ddp.py" and "--model" in args and options["env"]["OMP_NUM_THREADS"]
            self.labels.append((label, options.get("nproc", 1), options["env"]["OMP_NUM_THREADS"]))

        def measures(self):
            values = {label: iter(samples_per_s[label]) for label, _, _ in self.labels}
            return {label: (lambda label=label: next(values[label])) for label, _, _ in self.labels}

    scope = {"Rounds": Rounds, "compare": compare, "cpu_cores": lambda: cores, "accelerator_count": lambda: gpus,
             "QUICK": quick, "RUNS": "runs/03_ddp_five_steps"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(source, scope)  # noqa: S102 - the notebook's own lines
    return out.getvalue(), scope["speed"].labels


def test_03_sees_ddp_faster_only_when_five_rounds_agree():
    """Issue 52 item 3: 1 rank against 2, one thread per rank in both; 2 ranks x every core beside them. The
    verdict is computed from 5 interleaved rounds: faster when all 5 agree, "too noisy" otherwise. Quick mode
    leaves the oversubscribed configuration out (its rounds were most of the cell's time)."""
    faster = {"1 rank": [1000, 1010, 990, 1005, 995], "2 ranks": [1900, 1850, 1950, 1800, 1920],
              "2 ranks x 2 threads": [900, 950, 880, 700, 990]}
    out, labels = _run_03_speed_cell(faster)
    assert labels == [("1 rank", 1, "1"), ("2 ranks", 2, "1"), ("2 ranks x 2 threads", 2, "2")]
    assert "2 ranks: 1.90x" in out and "faster in every one of 5 rounds" in out, out
    assert "2 ranks x 2 threads: 0.4" in out and "slower in every one of 5 rounds" in out, out
    noisy = dict(faster, **{"2 ranks": [1900, 800, 1950, 1800, 1920]})
    out, _ = _run_03_speed_cell(noisy)
    assert "2 ranks:" in out and "too noisy to tell" in out and "faster in every" not in out.split("2 ranks x")[0], out
    out, labels = _run_03_speed_cell(faster, quick=True)
    assert labels == [("1 rank", 1, "1"), ("2 ranks", 2, "1")] and "2 ranks: 1.90x" in out and "threads" not in out
    out, labels = _run_03_speed_cell({}, gpus=1)
    assert out.startswith("skipped: comparing 1 rank with 2 needs 2 GPUs") and len(labels) == 2, out
    out, labels = _run_03_speed_cell({"1 rank": [10] * 5, "4 ranks": [39] * 5}, gpus=4)
    assert [label for label, *_ in labels] == ["1 rank", "4 ranks"] and "4 ranks: 3.90x" in out, out


def test_the_hardware_page_limits_torchruns_lost_redirects_on_windows_to_run_path_as_the_torch_source_does():
    """Audit D-1: `get_std_cm` is used only by `_wrap`, which runs function entrypoints (torchrun's --run-path);
    a script started as a subprocess gets its redirects as plain files."""
    import ast
    import inspect

    from torch.distributed.elastic.multiprocessing import api

    tree = ast.parse(inspect.getsource(api))
    callers = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
               for n in ast.walk(f) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "get_std_cm"}
    assert callers == {"_wrap"}
    sentence = next(s for s in (ROOT / "docs" / "hardware.md").read_text().split(". ") if "get_std_cm" in s)
    assert "--run-path" in sentence, sentence
