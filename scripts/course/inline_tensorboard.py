"""TensorBoard inside the notebook, plus the same curves as a matplotlib figure.

    show("runs/03_ddp")          # live iframe; reuses a running instance for the same log directory
    plot_scalars("runs/03_ddp")  # static curves read with TensorBoard's own event reader

Each TensorBoard runs in its own process session, so interrupting a training cell does not
kill it, and it carries a watchdog that exits when the notebook kernel that started it is gone.
``TENSORBOARD_PROXY_URL`` (e.g. ``/user/me/proxy/%PORT%/`` on JupyterHub) is honoured.
"""

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from tensorboard import manager, notebook

from course import ROOT

MODULE = "course.inline_tensorboard"


def _abs(logdir) -> str:
    path = Path(logdir)
    return str((path if path.is_absolute() else ROOT / path).resolve())


def _ours(info) -> bool:
    try:
        return MODULE in " ".join(psutil.Process(info.pid).cmdline())
    except psutil.Error:
        return False


def running(logdir=None) -> list:
    """Live TensorBoards started by this module (for one log directory, or all)."""
    return [i for i in manager.get_all() if _ours(i) and (logdir is None or i.logdir == _abs(logdir))]


def start(logdir, timeout: float = 120) -> "manager.TensorBoardInfo":
    """A TensorBoard serving ``logdir`` on a free port of 127.0.0.1: the live one if there is one.

    ``--port 0`` lets the kernel pick the port when TensorBoard binds it (its info file records the real one):
    a port chosen beforehand could be taken by another process in between."""
    logdir = _abs(logdir)
    Path(logdir).mkdir(parents=True, exist_ok=True)
    live = running(logdir)
    if live:
        return live[0]
    log = Path(logdir) / ".tensorboard.log"
    with open(log, "w") as log_file:  # the child keeps its own copy of the file descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--parent", str(os.getpid()),
             "--logdir", logdir, "--host", "127.0.0.1", "--port", "0", "--reload_interval", "5"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [i for i in manager.get_all() if i.pid == proc.pid]
        if found:
            return found[0]
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    proc.kill()
    proc.wait()
    why = "exited" if proc.returncode not in (-signal.SIGKILL, None) else f"did not answer within {timeout:.0f} s"
    last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-3:]
    raise RuntimeError(f"TensorBoard {why}; last lines of {log}:\n" + "\n".join(last))


def show(logdir, height: int = 520) -> None:
    """Embed TensorBoard for ``logdir`` in the cell output (an iframe served from 127.0.0.1) and print one line
    with its address. Returns None, so that ``show(...)`` as a cell's last line leaves no ``TensorBoardInfo(...)``
    repr under the frame (``start()`` returns the info), and nothing else is printed."""
    info = start(logdir)
    with contextlib.redirect_stdout(io.StringIO()):  # no "Selecting TensorBoard with ...": the note says where
        notebook.display(port=info.port, height=height)
    where = os.environ.get("TENSORBOARD_PROXY_URL", "http://127.0.0.1:%PORT%/").replace("%PORT%", str(info.port))
    print(f"(open it in its own tab: {where})")


def stop(logdir=None) -> int:
    """Stop the TensorBoards this module started (for one log directory, or all); returns how many."""
    infos = running(logdir)
    for info in infos:
        try:
            psutil.Process(info.pid).terminate()  # its SIGTERM handler removes its info file
        except psutil.Error:
            pass
    return len(infos)


def read_scalars(logdir) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{run: {tag: [(step, value), ...]}} for every run (directory with event files) under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(_abs(logdir))
    runs = sorted({p.parent for p in root.rglob("events.out.tfevents.*")})
    data = {}
    for run in runs:
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0 = keep every point
        acc.Reload()
        name = str(run.relative_to(root)) if run != root else run.name
        data[name] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return data


def plot_scalars(logdir, tags=None, title: str | None = None):
    """Plot scalars of every run under ``logdir``: one panel per tag, one line per run.

    For places where the live iframe cannot render (GitHub, nbviewer, a headless run)."""
    import matplotlib.pyplot as plt

    data = read_scalars(logdir)
    tags = tags or sorted({t for run in data.values() for t in run})
    if not tags:
        print(f"no scalars under {logdir} yet")
        return data
    fig, axes = plt.subplots(1, len(tags), figsize=(5 * len(tags), 3.4), squeeze=False)
    for ax, tag in zip(axes[0], tags):
        for run, scalars in data.items():
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=run)
        ax.set_title(tag)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    plt.show()
    return data


def _serve() -> None:
    """Entry point of the TensorBoard process: TensorBoard itself plus a watchdog on the kernel."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=int, required=True)
    ours, rest = parser.parse_known_args()

    def leave(*_):
        manager.remove_info_file()  # so that no stale entry points a later show() at a dead port
        os._exit(0)

    def watch():
        while psutil.pid_exists(ours.parent):
            time.sleep(1)
        leave()

    signal.signal(signal.SIGTERM, leave)
    threading.Thread(target=watch, daemon=True).start()
    from tensorboard.main import run_main

    sys.argv = ["tensorboard", *rest]
    run_main()


if __name__ == "__main__":
    _serve()
