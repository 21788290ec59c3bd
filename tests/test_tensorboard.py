"""Inline TensorBoard: one instance per log directory, reused, in its own session, cleaned up; curves
read back with TensorBoard's own event reader."""

import importlib
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from course.inline_tensorboard import plot_scalars, read_scalars, running, show, start, stop
from course.runlog import RunLog


@pytest.fixture
def logdir(tmp_path):
    log = RunLog(tmp_path / "exp" / "run_a", world_size=1)
    for step in range(5):
        log.scalar("train/loss", 1.0 / (step + 1), step)
    log.finish(val_accuracy=0.5)
    yield tmp_path / "exp"
    stop(tmp_path / "exp")


def test_scalars_are_read_back_with_tensorboards_reader(logdir):
    data = read_scalars(logdir)
    assert list(data) == ["run_a"]
    assert [round(v, 4) for _, v in data["run_a"]["train/loss"]] == [1.0, 0.5, 0.3333, 0.25, 0.2]


def test_resuming_a_finished_run_keeps_its_curve(logdir):
    """A run that finished at step 4 and is resumed from its step-2 checkpoint: steps 0-2 stay, 3-6 are new."""
    log = RunLog(logdir / "run_a", world_size=1, resume_step=2)
    for step in range(3, 7):
        log.scalar("train/loss", 10.0 + step, step)
    log.finish()
    assert [(s, round(v, 2)) for s, v in read_scalars(logdir)["run_a"]["train/loss"]] == \
        [(0, 1.0), (1, 0.5), (2, 0.33), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0)]


def test_plot_scalars_draws_every_tag(logdir, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    data = plot_scalars(logdir)
    assert set(data["run_a"]) == {"train/loss"}


def test_one_instance_per_logdir_reused_and_stopped(logdir):
    first = start(logdir)
    again = start(logdir)
    assert first.pid == again.pid and first.port == again.port
    assert psutil.Process(first.pid).status() != psutil.STATUS_ZOMBIE
    with urllib.request.urlopen(f"http://127.0.0.1:{first.port}/data/runs", timeout=10) as reply:
        assert b"run_a" in reply.read()
    import os

    assert os.getpgid(first.pid) != os.getpgid(0), "TensorBoard must not be in the kernel's process group"
    assert stop(logdir) == 1
    psutil.wait_procs([psutil.Process(first.pid)], timeout=10)
    assert not psutil.pid_exists(first.pid) or psutil.Process(first.pid).status() == psutil.STATUS_ZOMBIE
    assert running(logdir) == []


def test_tensorboard_exits_when_the_kernel_that_started_it_dies(logdir):
    code = f"from course.inline_tensorboard import start; print(start({str(logdir)!r}).pid, flush=True)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    pid = int(child.stdout.split()[-1])  # the "kernel" has exited by now
    deadline = time.monotonic() + 15
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "TensorBoard outlived its kernel"
        time.sleep(0.5)


def test_display_honours_tensorboard_proxy_url(logdir, monkeypatch, capsys):
    notebook = importlib.import_module("tensorboard.notebook")  # the real module, not the lazy proxy
    shown = []
    monkeypatch.setattr(notebook, "_get_context", lambda: notebook._CONTEXT_IPYTHON)  # as inside a kernel
    monkeypatch.setattr("IPython.display.display", lambda obj, **kw: shown.append(obj))
    monkeypatch.setenv("TENSORBOARD_PROXY_URL", "/user/me/proxy/%PORT%/")
    assert show(logdir) is None
    port = start(logdir).port  # the running one, reused
    html = shown[0].data
    assert f'"/user/me/proxy/{port}/"' in html and "<iframe" in html
    assert f"/user/me/proxy/{port}/" in capsys.readouterr().out


def test_show_leaves_the_frame_and_one_line_only(logdir, monkeypatch, capsys):
    """Issue 52: a raw ``TensorBoardInfo(...)`` repr appeared under every inline TensorBoard (show() returned the
    info, the cell's last value) beside tensorboard's own "Selecting TensorBoard with ..." line. Run as a cell's
    last line in an IPython shell, show() leaves the frame and its one-line note, nothing else."""
    from IPython.core.interactiveshell import InteractiveShell

    notebook = importlib.import_module("tensorboard.notebook")
    shown = []
    monkeypatch.setattr(notebook, "_get_context", lambda: notebook._CONTEXT_IPYTHON)
    monkeypatch.setattr("IPython.display.display", lambda obj, **kw: shown.append(obj))
    monkeypatch.delenv("TENSORBOARD_PROXY_URL", raising=False)
    shell = InteractiveShell.instance()
    try:
        shell.run_cell(f"from course.inline_tensorboard import show\nshow({str(logdir)!r})", store_history=False)
        last_value = shell.user_ns.get("_")
    finally:
        InteractiveShell.clear_instance()
    out = capsys.readouterr().out
    port = start(logdir).port
    assert len(shown) == 1 and "<iframe" in shown[0].data, shown
    assert out.splitlines() == [f"(open it in its own tab: http://127.0.0.1:{port}/)"], out
    assert "TensorBoardInfo" not in out and last_value in (None, ""), (out, last_value)
