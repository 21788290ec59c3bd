"""Imported by Python at start-up in every process the runner starts (run_commands puts this folder first on
PYTHONPATH); never in a learner's own runs of a script.

Gloo's exit race (pytorch/pytorch#117762): a gloo worker thread marks a collective done, wakes the script, and only
then lets go of the collective's tensors. If it is descheduled in between (a busy machine) and the script meanwhile
reaches its end, the thread lets go while Python is finalizing, cannot take the interpreter lock, and the process
aborts ("terminate called without an active exception") after the script's last line; a barrier does not help,
since gloo runs collectives on two worker threads. Here, at exit and while Python can still take the tensors back,
the process waits until its other threads are no longer runnable (on Linux, from /proc; elsewhere a short pause),
at most ``EXIT_WAIT_S``. The launcher still names the abort if it happens (ddp_doctor.runner.torchrun_output).

Where each rank is, on request: a rank of a job whose launcher gave it a folder (``COURSE_STACKS_DIR``) dumps its
Python stack there on SIGUSR2, and asks the other ranks for theirs when its own wait times out (``_course_stacks.py``).
"""

import atexit
import os
import sys
import threading
import time

EXIT_WAIT_S = 5.0  # a runnable thread on a busy 2-core machine can wait seconds for a CPU (CI, 2026-12-07)


def _runnable_threads() -> int | None:
    """How many of this process's threads, other than this one, are running or waiting for a CPU; None if unknown."""
    me = threading.get_native_id()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tasks:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        count += state == "R"
    return count


def _let_threads_finish() -> None:
    if "torch.distributed" not in sys.modules:
        return
    deadline, quiet = time.monotonic() + EXIT_WAIT_S, 0
    while quiet < 5 and time.monotonic() < deadline:
        runnable = _runnable_threads()
        if runnable is None:  # no /proc (macOS): give the threads a moment
            time.sleep(0.05)
            return
        quiet = quiet + 1 if runnable == 0 else 0
        time.sleep(0.004)  # releases the interpreter lock


def _run_the_environments_own() -> None:
    """This module takes the name ``sitecustomize``: run the one the environment has further down the path, if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec and spec.loader:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _stacks_on_request() -> None:
    folder = os.environ.get("COURSE_STACKS_DIR")
    if folder and os.environ.get("RANK") is not None and os.environ.get("LOCAL_RANK") is not None:  # a rank
        try:
            import _course_stacks  # this file's folder is first on the path

            _course_stacks.install(folder, os.environ["RANK"])
        except Exception:  # noqa: BLE001, S110 - the job runs all the same; only its stack on a timeout is lost
            pass


atexit.register(_let_threads_finish)
_stacks_on_request()
_run_the_environments_own()
