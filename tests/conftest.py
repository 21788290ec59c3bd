"""Shared test helpers. Tests run real torchrun jobs with gloo on the CPU."""

import time

import psutil
import pytest

from course import ROOT


def processes_running(marker: str) -> list[psutil.Process]:
    """Processes whose command line mentions ``marker`` (a script name), excluding this test process."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != psutil.Process().pid and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def wait_for_no_processes(marker: str, timeout: float = 10) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = processes_running(marker)
        if not left:
            return []
        time.sleep(0.2)
    return processes_running(marker)


@pytest.fixture(scope="session")
def datasets():
    """The generated datasets (made once; `make test` has already run `make data`)."""
    from course.data import ensure_datasets

    ensure_datasets(quiet=True)
    return ROOT / "data"
