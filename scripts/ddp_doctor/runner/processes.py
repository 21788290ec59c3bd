"""No process left behind: end a process tree, a watchdog that ends a job (and removes its temporary
folders) when the process that launched it dies, the launcher's log folders named by their owner, and
free ports.

The watchdog runs as ``python -m ddp_doctor.runner.processes PARENT CREATED PIDS REMOVE`` (JSON lists):
when PARENT dies by any signal, SIGKILL included (a killed notebook kernel), or when the watchdog itself
is told to stop (SIGTERM: stopping Lab ends the whole tree it started), it ends the job's process trees
and removes the folders. It exits by itself when they have all ended. Same on Linux and macOS (it
polls; no Linux-only prctl).

A log folder (``log_folder()``) is named after the process that made it. When the owner and its watchdog
are both killed outright (SIGKILL of ``make lab``: Lab's watchdog ends the kernel, then kills the job's
watchdog before it has removed anything), whoever is left cleans up: every watchdog that ends a job, and
every launch, removes the folders whose owner is gone (``remove_orphaned_log_folders``).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import psutil
except ImportError:  # the doctor taken home (torch its only requirement): the process table read by hand
    from ddp_doctor.runner import procinfo as psutil

HOME = Path(__file__).resolve().parents[2]  # the folder that holds the ddp_doctor package: the watchdog imports it


def start_watchdog(pids: list[int], remove=()) -> subprocess.Popen:
    """Start the watchdog for these process trees; ``remove``: folders it deletes when it ends them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOME), *filter(None, [os.environ.get("PYTHONPATH")])])}
    argv = [sys.executable, "-m", "ddp_doctor.runner.processes", str(os.getpid()), repr(psutil.Process().create_time()),
            json.dumps(list(pids)), json.dumps([str(r) for r in remove])]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True, env=env)


LOG_PREFIX = "course-torchrun-"
OWNED = re.compile(rf"{LOG_PREFIX}(\d+)-(\d+)-")  # owner's pid and creation time (s)


def log_folder() -> str:
    """A new temporary folder for torchrun's logs, named after this process (its pid and start time)."""
    me = psutil.Process()
    return tempfile.mkdtemp(prefix=f"{LOG_PREFIX}{me.pid}-{round(me.create_time())}-")


def remove_orphaned_log_folders(where=None) -> list[Path]:
    """Remove the log folders in the temporary directory whose owner process has ended; returns them."""
    removed = []
    for folder in Path(where or tempfile.gettempdir()).glob(f"{LOG_PREFIX}*"):
        owner = OWNED.match(folder.name)
        if owner and folder.is_dir() and not _parent_alive(int(owner[1]), float(owner[2])):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def watch(parent: int, created: float, pids: list[int], remove: list[str], poll: float = 0.5) -> None:
    """The watchdog's loop (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watched: dict[int, psutil.Process] = {}

    def refresh():  # the ranks too: if torchrun died first they would no longer be its children
        for pid in list(pids):
            try:
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    watched.setdefault(proc.pid, proc)
            except psutil.Error:
                pass
        for pid, proc in list(watched.items()):
            if not _running(proc):
                del watched[pid]

    def end_job(*_):
        refresh()
        _end(list(watched.values()), grace=1)  # nobody reads the output any more: no need to wait long
        for folder in remove:
            shutil.rmtree(folder, ignore_errors=True)
        remove_orphaned_log_folders()  # those of a job whose own watchdog was killed with the tree ended here
        os._exit(0)

    signal.signal(signal.SIGTERM, end_job)  # stopped with the tree it belongs to: the job goes with it
    refresh()
    ticks = 0
    while watched:
        if not _parent_alive(parent, created):
            end_job()
        time.sleep(poll)
        ticks += 1
        if ticks % 4 == 0:
            refresh()
        else:
            watched = {pid: p for pid, p in watched.items() if _running(p)}


def _parent_alive(parent: int, created: float) -> bool:
    try:
        proc = psutil.Process(parent)
        return abs(proc.create_time() - created) < 1 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after ``grace`` s (zombies count as ended)."""
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    for signal_after_grace in (True, False):
        deadline = time.monotonic() + grace
        while True:
            alive = [p for p in procs if _running(p)]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not signal_after_grace:
            break
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass


def _running(proc: psutil.Process) -> bool:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            proc.wait(0)  # our own child: reap it; another process's zombie: its parent will
            return False
        return proc.is_running()
    except (psutil.Error, ChildProcessError):
        return False


def tree_pids(pid: int) -> list[int]:
    """A process and all its descendants (their pids); [] if it has ended."""
    try:
        root = psutil.Process(pid)
        return [root.pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


def kill_tree(pid: int, grace: float = 5.0) -> int:
    """End a process and all its descendants (SIGTERM, then SIGKILL after ``grace`` s); returns the count."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    _end(procs, grace)
    return len(procs)


def free_port(preferred: int | None = None) -> int:
    """``preferred`` if nothing listens there, else any free port of 127.0.0.1."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]))
