"""`python -m course.lab` (make lab): closing its terminal (SIGHUP) ends JupyterLab, its kernels, and
removes its temporary folder; SIGTERM and SIGINT take the same path (checked without starting Lab again)."""

import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from course import ROOT
from course.launcher import free_port


def test_sighup_ends_lab_and_removes_its_folder(wait_until):
    helper = subprocess.Popen([sys.executable, "-m", "course.lab", "--no-browser", "--port", str(free_port())],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)  # as a terminal would: its own session
    seen, tree = [], []
    threading.Thread(target=lambda: seen.extend(helper.stdout), daemon=True).start()
    try:
        wait_until(lambda: any("JupyterLab is running" in line for line in list(seen)), 150, "Lab to answer")
        lab = [p for p in psutil.Process(helper.pid).children() if "jupyterlab" in " ".join(p.cmdline())]
        assert len(lab) == 1, seen
        state = Path(lab[0].environ()["JUPYTER_RUNTIME_DIR"]).parent
        assert state.name.startswith("course-lab-") and state.is_dir()
        tree += [lab[0], *lab[0].children(recursive=True)]
        helper.send_signal(signal.SIGHUP)
        assert helper.wait(30) == 0
        wait_until(lambda: not any(_alive(p) for p in tree), 10, "Lab and its children to end")
        assert not state.exists()
        assert any("stopping JupyterLab (SIGHUP)" in line for line in seen), seen
    finally:
        helper.kill()
        for proc in tree:
            if _alive(proc):
                proc.kill()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_every_stop_signal_raises_stopped():
    """SIGHUP, SIGTERM and SIGINT all end in main's `finally: stop_lab(...)`: each raises Stopped."""
    from course.lab import STOP_SIGNALS, Stopped, install_stop_handlers

    assert {signal.SIGHUP, signal.SIGTERM, signal.SIGINT} <= set(STOP_SIGNALS)
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        install_stop_handlers()
        for sig in STOP_SIGNALS:
            with pytest.raises(Stopped, match=sig.name):
                signal.raise_signal(sig)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
