"""Each rank's Python stack on request, for the runner (imported by ``sitecustomize.py`` in every rank the runner
starts, and by ``ddp_doctor.runner.stacks``; it imports nothing but the standard library).

A rank (a process with ``RANK`` set) registers ``faulthandler`` on ``SIGNAL`` with a file of its own in the job's
folder (``COURSE_STACKS_DIR``), named ``rank<R>-<pid>-<start>.txt``; its first line names its main thread. Then:
- the launcher, at its timeout, sends ``SIGNAL`` to every rank of the job (``ask``), waits briefly for the dumps,
  and only then stops the job;
- a rank whose own wait timed out (the process-group timeout: "Timed out waiting", "Application timeout caused
  pair closure") asks the other ranks itself, before its traceback is printed: once it exits, torchrun ends them.
  Its file then says why it asked (a line ``asked: <its error>``).
A process a rank starts with ``RANK`` in its environment (a spawned DataLoader worker) does not register: its
parent answers for it. faulthandler writes from the signal handler itself, so a rank blocked in C++ (a collective,
a queue of DataLoader workers) answers too; only a rank that is stopped or dead does not.
"""

import faulthandler
import glob
import os
import re
import signal
import threading
import time

ENV = "COURSE_STACKS_DIR"
# torchrun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to its ranks (--signals-to-handle); SIGUSR1 is SLURM's and
# the course's own scripts' (``kill -USR1 <pid>`` in notebook 04b); SIGUSR2 is left to us.
SIGNAL = getattr(signal, "SIGUSR2", None)
NAME = re.compile(r"rank(\d+)-(\d+)-(\d+)\.txt$")
TIMED_OUT = re.compile(r"timed out|timeout caused|wait timeout|operation timeout|socket timeout", re.IGNORECASE)
ASKED = "asked: "
_open: list = []  # the registered files: faulthandler writes to their descriptors


def started(pid: int) -> str:
    """The process's start time in clock ticks (Linux); "0" where unknown. A pid whose start differs is no longer
    the rank that registered (it ended; the pid may be another process's): it is never signalled."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def register(folder: str, rank: str):
    """Dump every thread's stack into this rank's file on ``SIGNAL``; returns the open file (None: not here)."""
    if SIGNAL is None or not os.path.isdir(folder):
        return None
    if glob.glob(os.path.join(folder, f"rank{rank}-{os.getppid()}-*.txt")):  # started by a rank: it answers
        return None
    path = os.path.join(folder, f"rank{rank}-{os.getpid()}-{started(os.getpid())}.txt")
    f = open(path, "w")  # noqa: SIM115 - open for the whole run: faulthandler writes to it on the signal
    f.write(f"main thread 0x{threading.get_ident():016x}\n")
    f.flush()
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    _open.append(f)
    return f


def registered(folder: str) -> list[tuple[int, int, str, str]]:
    """(rank, pid, start, path) of every process registered in ``folder``."""
    found = []
    for path in glob.glob(os.path.join(folder, "rank*.txt")):
        m = NAME.search(path)
        if m:
            found.append((int(m[1]), int(m[2]), m[3], path))
    return sorted(found)


def ask(folder: str, pids=None, wait: float = 3.0) -> list[str]:
    """Send ``SIGNAL`` to the registered ranks still running (among ``pids`` if given; never this process) and wait,
    at most ``wait`` s, until each has written its stack; returns the files of the ranks asked."""
    sizes = {}
    for _, pid, start, path in registered(folder):
        if pid == os.getpid() or (pids is not None and pid not in pids):
            continue
        if start != "0" and started(pid) != start:
            continue
        try:
            size = os.path.getsize(path)
            os.kill(pid, SIGNAL)
        except OSError:
            continue
        sizes[path] = size
    deadline, waiting = time.monotonic() + wait, dict(sizes)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.1)
        for path, before in list(waiting.items()):
            try:
                now = os.path.getsize(path)
            except OSError:
                now = before
            if now > before and now == waiting[path]:  # it wrote, and has stopped writing
                del waiting[path]
            elif now > before:
                waiting[path] = now
    return list(sizes)


def timed_out(error: BaseException) -> bool:
    """Whether an uncaught error is a wait that ran out (a collective, the store): the other ranks are elsewhere."""
    return isinstance(error, TimeoutError) or bool(TIMED_OUT.search(f"{type(error).__name__}: {error}"))


def install(folder: str, rank: str) -> None:
    """Register this rank; an uncaught timeout makes it ask the other ranks where they are before it goes on."""
    import sys

    own = register(folder, rank)
    if own is None:
        return
    previous = sys.excepthook

    def hook(kind, error, tb):
        if timed_out(error):
            try:
                own.write(ASKED + " ".join(f"{kind.__name__}: {error}".split())[:300] + "\n")
                own.flush()  # through faulthandler's own descriptor: a later dump goes after it
                ask(folder)
            except Exception:  # noqa: BLE001, S110 - never stand between a rank and its own traceback
                pass
        previous(kind, error, tb)

    sys.excepthook = hook
