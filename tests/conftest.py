"""Shared test helpers, one home each. Tests run real torchrun jobs with gloo on the CPU.

Plain functions (``from conftest import ...``, e.g. in tests/browser_helpers.py) and the same as fixtures:
- ``processes_with(fragment, env=None)``: live processes (not zombies, not this one) whose command line
  mentions ``fragment`` (a script path), optionally only those whose environment holds ``env``
- ``wait_no_processes(marker, timeout=10)``: polls until none is left; returns those still running
- ``wait_until(condition, timeout, what, poll=0.2)``: ``condition()``'s first truthy value, else the test
  fails naming what was awaited
- ``run(script, nproc, args, run_dir, **launch_options)``: a quiet ``course.launcher.launch``
"""

import time

import psutil
import pytest

from course import ROOT


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
