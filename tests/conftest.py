"""Shared test helpers, one home each. Tests run real torchrun jobs with gloo on the CPU.

Plain functions (``from conftest import ...``, e.g. in tests/browser_helpers.py) and the same as fixtures:
- ``processes_with(fragment, env=None)``: live processes (not zombies, not this one) whose command line
  mentions ``fragment`` (a script path), optionally only those whose environment holds ``env``
- ``wait_no_processes(marker, timeout=10)``: polls until none is left; returns those still running
- ``wait_until(condition, timeout, what, poll=0.2)``: ``condition()``'s first truthy value, else the test
  fails naming what was awaited
- ``run(script, nproc, args, run_dir, **launch_options)``: a quiet ``course.launcher.launch``
- ``executed_notebook(stem)``: the notebook run headless once per test session, as ``make course`` runs it;
  tests assert on what that one run printed and wrote rather than running its scripts again
- ``notebook_scripts(path)``: the scripts a notebook writes (``%%writefile``) and the script names its other
  code cells mention
- ``notebooks_that_clash(stems)``: the pairs of notebooks that must not run at the same time (one launches a
  script the other writes, or both belong to one chapter)
- ``charge(wall, parts)``: a shared fixture's ``wall`` seconds split over the course's parts (weights by part)

At the end the suite prints its time by part of the course (00-09 and the deep dives 10-12): the budget is 30 min
for 00-09 and 45 in all. A test counts for its part by file or parameter; a shared run (every notebook, every
launched exercise) is split by what each part's own jobs took.
"""

import json
import os
import re
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import psutil
import pytest

from course import ROOT, RUNS, WEIGHTS


def processes_with(fragment: str, env: dict | None = None) -> list[psutil.Process]:
    found = []
    me = psutil.Process().pid
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if (proc.pid == me or fragment not in " ".join(proc.info["cmdline"] or ())
                    or proc.info["status"] == psutil.STATUS_ZOMBIE):
                continue
            if env and any(proc.environ().get(name) != value for name, value in env.items()):
                continue
            found.append(proc)
        except psutil.Error:  # ended meanwhile
            pass
    return found


def wait_until(condition, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def wait_for_no_processes(marker: str, timeout: float = 10) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not processes_with(marker):
            return []
        time.sleep(0.2)
    return processes_with(marker)


def run(script, nproc, args, run_dir, timeout: float = 600, **kw):
    """``launch`` with its output dropped (the result holds it), for tests that assert on what a run wrote."""
    from course.launcher import launch

    return launch(script, nproc=nproc, args=[str(a) for a in args], run_dir=run_dir, timeout=timeout,
                  on_line=lambda _: None, quiet=True, **kw)


@dataclass
class NotebookRun:
    """One headless run of a notebook (quick mode, Check yourself answered from its key) and what it left."""

    stem: str
    ok: bool
    seconds: float
    error: str
    executed: Path  # the executed copy, outputs included
    started: float  # time.time() when the run began: files older than this were not written by it

    def require_ok(self):
        if not self.ok:
            pytest.fail(f"notebook {self.stem} failed headless (its own test shows where):\n{self.error[-2000:]}")
        return self

    def written(self, path: Path) -> Path:
        self.require_ok()
        assert path.is_file() and path.stat().st_mtime >= self.started - 1, f"{path} was not written by this run"
        return path

    def metrics(self, run: str, folder: str | None = None) -> dict:
        """metrics.json of the notebook's run ``run`` (runs/<folder or stem>/<run>/metrics.json), written by this
        run (notebooks 04 and 04b share runs/04_pitfalls)."""
        return json.loads(self.written(RUNS / (folder or self.stem) / run / "metrics.json").read_text())

    def weights(self, name: str) -> Path:
        return self.written(WEIGHTS / self.stem / name)

    def output(self) -> str:
        """Everything the notebook's cells printed, in order."""
        import nbformat

        nb = nbformat.read(self.executed, as_version=4)
        texts = []
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                texts.append(out.get("text", "") or "".join(out.get("data", {}).get("text/plain", "")))
        return "\n".join(texts)


DEEP_DIVE_FILES = ("test_tensor_parallel.py", "test_pipeline_parallel.py", "test_composed_parallelism.py",
                   "test_model_parallel_args.py")
DEEP_DIVES = ("10", "11", "12")  # notebooks of the deep dives; their exercises are 7, 8 and 9
DEEP_DIVE_EXERCISES = ("7", "8", "9")
_SPENT: dict[str, float] = {}  # nodeid -> seconds (setup, call and teardown)
_SPLIT: dict[str, dict[str, float]] = {}  # nodeid -> {part: seconds} of a shared run inside it


def part_of(name: str) -> str:
    """'10-12' for a notebook stem, an exercise key or a test id of the deep dives, else '00-09'."""
    path, _, rest = name.partition("::")
    param = rest.partition("[")[2]
    deep = (Path(path).name in DEEP_DIVE_FILES or name[:2] in DEEP_DIVES or param[:2] in DEEP_DIVES
            or name in DEEP_DIVE_EXERCISES or param.partition("/")[0] in DEEP_DIVE_EXERCISES)
    return "10-12" if deep else "00-09"


def charge(wall: float, parts: dict[str, float]) -> None:
    """Split ``wall`` seconds of the running test over the parts, in proportion to ``parts`` (part -> weight)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" ")[0]
    total = sum(parts.values())
    if test and total:
        for part, weight in parts.items():
            _SPLIT.setdefault(test, {}).setdefault(part, 0.0)
            _SPLIT[test][part] += wall * weight / total


def pytest_runtest_logreport(report):
    _SPENT[report.nodeid] = _SPENT.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    by_part = {"00-09": 0.0, "10-12": 0.0}
    for nodeid, seconds in _SPENT.items():
        shared = _SPLIT.get(nodeid, {})
        by_part[part_of(nodeid)] += seconds - sum(shared.values())
        for part, share in shared.items():
            by_part[part] += share
    terminalreporter.write_line("suite time by part of the course: " + ", ".join(
        f"{part} {seconds / 60:.1f} min" for part, seconds in by_part.items())
        + f" (budgets: 00-09 30 min, all 45 min; {sum(by_part.values()) / 60:.1f} min in tests)")


_EXECUTED: dict[str, NotebookRun] = {}
_PLANNED: list[str] = []  # notebooks this session executes anyway (test_notebooks), run together on first need
WRITEFILE = "%%writefile ../scripts/"


def notebook_scripts(path: Path) -> tuple[dict[str, str], set[str]]:
    """({script name: the exact text its %%writefile cell writes}, {script names the other code cells mention})."""
    import nbformat

    written, mentioned = {}, set()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        if cell.source.startswith(WRITEFILE):
            first, _, body = cell.source.partition("\n")
            name = first[len(WRITEFILE):].strip()
            assert name not in written, f"{name} is written by two cells of {path.name}"
            written[name] = body if body.endswith("\n") else body + "\n"  # IPython adds the newline
        else:
            mentioned |= set(re.findall(r"(\w+\.py)\b", cell.source))
    return written, mentioned


def notebooks_that_clash(stems) -> set[frozenset]:
    """Pairs of notebooks that must not run at the same time: one launches a script the other writes
    (%%writefile empties the file before writing it), or both belong to one chapter (04 and 04b share
    runs/04_pitfalls)."""
    scripts = {stem: notebook_scripts(ROOT / "notebooks" / f"{stem}.ipynb") for stem in stems}
    return {frozenset((a, b)) for a in stems for b in stems if a < b and
            (a[:2] == b[:2] or scripts[a][0].keys() & scripts[b][1] or scripts[b][0].keys() & scripts[a][1])}


def pytest_collection_finish(session):
    """Plan the notebooks that the selected tests of test_notebooks execute: the first test that needs any of
    them runs them all."""
    stems = {item.callspec.params["path"].stem for item in session.items
             if item.originalname == "test_notebook_executes_headless"}
    _PLANNED[:] = sorted(stems) if len(stems) > 1 else []


def _execute(stem: str) -> NotebookRun:
    from course.run_notebooks import execute

    out = Path(tempfile.mkdtemp(prefix=f"course-notebook-{stem}-"))
    started = time.time()
    ok, seconds, error = execute(ROOT / "notebooks" / f"{stem}.ipynb", out_dir=out)
    return NotebookRun(stem, ok, seconds, error, out / f"{stem}.ipynb", started)


def _execute_planned(at_once: int) -> None:
    """Every planned notebook, ``at_once`` at a time (two on the 2-core machine: much of a notebook's time is one
    core importing torch or waiting on a timeout). Two that clash never overlap, the earlier one by name runs
    first, and a notebook that others wait for starts before those that hold nobody up."""
    pending = [stem for stem in _PLANNED if stem not in _EXECUTED]
    _PLANNED.clear()
    clash = notebooks_that_clash(pending)
    waits_for = {s: [t for t in pending if t < s and frozenset((s, t)) in clash] for s in pending}
    holds_up = {s: sum(s in waits_for[t] for t in pending) for s in pending}
    running = {}
    with ThreadPoolExecutor(at_once) as pool:
        while pending or running:
            ready = [s for s in pending if all(t in _EXECUTED for t in waits_for[s])
                     and not any(frozenset((s, r)) in clash for r in running.values())]
            for stem in sorted(ready, key=lambda s: (-holds_up[s], s))[:at_once - len(running)]:
                pending.remove(stem)
                running[pool.submit(_execute, stem)] = stem
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                _EXECUTED[running.pop(future)] = future.result()


def executed_notebook(stem: str) -> NotebookRun:
    """Notebook ``notebooks/<stem>.ipynb`` executed headless once per session (the first caller pays, a few
    minutes), as `make course QUICK=1` runs it. Its runs go where the notebook puts them (runs/<stem>/...).
    When the session executes several notebooks anyway, the first caller runs them all, two at a time
    (``COURSE_TEST_NOTEBOOKS_AT_ONCE``, 1 for one at a time)."""
    if stem not in _EXECUTED:
        from course.datagen import ensure_datasets

        ensure_datasets(quiet=True)
        at_once = max(1, int(os.environ.get("COURSE_TEST_NOTEBOOKS_AT_ONCE", "2"))) if stem in _PLANNED else 1
        # Two notebooks share the 2 cores: OpenMP threads that spin while they wait would take the other's turn
        # (measured: a 2-thread training beside another, 4.3 s spinning, 1.8 s sleeping; alone 1.2 s).
        sleep = {"OMP_WAIT_POLICY": "PASSIVE"} if at_once > 1 else {}
        with mock.patch.dict(os.environ, {"COURSE_QUICK": "1", "COURSE_ANSWER_KEY": "1", **sleep}):  # kernels inherit it
            started, before = time.monotonic(), set(_EXECUTED)
            if at_once > 1:
                _execute_planned(at_once)
            if stem not in _EXECUTED:
                _EXECUTED[stem] = _execute(stem)
            ran = [_EXECUTED[s] for s in _EXECUTED if s not in before]
            charge(time.monotonic() - started, {part: sum(r.seconds for r in ran if part_of(r.stem) == part)
                                                for part in ("00-09", "10-12")})
    return _EXECUTED[stem]


@pytest.fixture(name="find_processes")
def _find_processes():
    """Processes whose command line mentions a marker (a script path), excluding this test process."""
    return processes_with


@pytest.fixture(name="wait_no_processes")
def _wait_no_processes():
    """Wait until no process mentions the marker; returns the processes still running after ``timeout``."""
    return wait_for_no_processes


@pytest.fixture(name="wait_until")
def _wait_until():
    """Poll a condition until it is true (returns its value), else fail the test naming what was awaited."""
    return wait_until


@pytest.fixture(scope="session")
def datasets():
    """The generated datasets (made once; `make test` has already run `make data`)."""
    from course.datagen import ensure_datasets

    ensure_datasets(quiet=True)
    return ROOT / "data"
