"""Shared test fixtures. Tests run real torchrun jobs with gloo on the CPU.

Fixtures for processes (use them as test arguments, not imports):
- ``find_processes(marker)``: processes whose command line mentions ``marker`` (a script path)
- ``wait_no_processes(marker, timeout=10)``: polls until none is left; returns those still running
- ``wait_until(condition, timeout, what)``: polls ``condition()`` until true, else fails the test
"""

import time

import psutil
import pytest

from course import ROOT


def _processes_running(marker: str) -> list[psutil.Process]:
    found = []
    me = psutil.Process().pid
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != me and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _wait_for_no_processes(marker: str, timeout: float = 10) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _processes_running(marker):
            return []
        time.sleep(0.2)
    return _processes_running(marker)


def _wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def find_processes():
    """Processes whose command line mentions a marker (a script path), excluding this test process."""
    return _processes_running


@pytest.fixture
def wait_no_processes():
    """Wait until no process mentions the marker; returns the processes still running after ``timeout``."""
    return _wait_for_no_processes


@pytest.fixture
def wait_until():
    """Poll a condition until it is true (returns its value), else fail the test naming what was awaited."""
    return _wait_until


# Deprecated: the old importable names, kept until every test uses the fixtures above
# (tests/test_pitfalls.py still imports wait_for_no_processes).
processes_running = _processes_running
wait_for_no_processes = _wait_for_no_processes


@pytest.fixture(scope="session")
def datasets():
    """The generated datasets (made once; `make test` has already run `make data`)."""
    from course.datagen import ensure_datasets

    ensure_datasets(quiet=True)
    return ROOT / "data"
