"""The checker's ranks, started from a warm process: torch imported once, each rank a fork (Linux, CPU ranks).

A check runs the learner's script on NPROC ranks under the recorder. Started by torchrun, every check starts three
Pythons that each import torch (torchrun's agent and two ranks; with DDP also torch._dynamo): about 7 of a check's
10 CPU-seconds on a 2-core box, before any of the learner's code runs. Here one rank server per caller (a notebook
kernel, the test process; ``course.rank_server``) imports torch once, and each rank is a ``fork`` of it, with the
environment torchrun gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...). What the checker reads stays
the same: each rank's output tagged ``[rankN]:`` as torchrun tags it, its exit code, the recorder's files, where each
rank was at a timeout (``ddp_doctor.runner.stacks``), and, as torchrun does, the other ranks stopped once one fails.

No rank is left behind: an interrupted or timed-out check ends its ranks; a watchdog per job
(``ddp_doctor.runner.processes``) ends them if the caller dies; the server ends its ranks and exits when its input
closes (the caller gone, or at its exit). Elsewhere than Linux (macOS forbids much after fork), for ranks on GPUs,
or with COURSE_CHECK_FORK=0, the checker launches torchrun.
"""

import atexit
import contextlib
import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def usable() -> bool:
    return sys.platform == "linux" and os.environ.get("COURSE_CHECK_FORK", "1") != "0"


@dataclass
class Ended:
    """A forked job's end: ``returncode`` None when it was stopped at the timeout; ``order``: the ranks that failed,
    first to fail first; ``output``: each rank's lines tagged ``[rankN]:`` as torchrun tags them."""

    returncode: int | None
    output: str
    places: str
    order: list[int]


class _Server:
    def __init__(self):
        from ddp_doctor.runner.processes import HOME  # scripts/: ddp_doctor and course
        from ddp_doctor.runner.run import STARTUP  # sitecustomize: the exit-race pause; _course_stacks

        path = [str(STARTUP), str(HOME)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])}
        for name in ("RANK", "LOCAL_RANK", "COURSE_STACKS_DIR"):
            env.pop(name, None)
        # Unbuffered pipes: no lock of a buffered reader for the reading thread to hold while the interpreter ends.
        self.proc = subprocess.Popen([sys.executable, "-m", "course.rank_server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0,
                                     start_new_session=True)  # an interrupt of the caller's group is the caller's
        atexit.register(self.close)
        self.queues: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        ready = queue.Queue()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        try:
            first = ready.get(timeout=120)
        except queue.Empty:
            first = None
        if not first or first.get("threads") != 1:
            self.proc.kill()
            raise RuntimeError(f"the checker's rank server did not start ({first})")

    def close(self) -> None:
        """At the caller's exit: the server's input closed, so it ends its ranks and exits (its output then ends)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()

    def _lines(self):
        pending = b""
        while chunk := os.read(self.proc.stdout.fileno(), 1 << 16):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            yield from lines

    def _read(self, ready: queue.Queue) -> None:
        for line in self._lines():
            try:
                event = json.loads(line)
            except ValueError:  # not the server's (nothing else writes there): ignored
                continue
            if "ready" in event:
                ready.put(event)
            elif (q := self.queues.get(event.get("job"))) is not None:  # a job that ended meanwhile: dropped
                q.put(event)
        ready.put(None)
        for q in list(self.queues.values()):
            q.put(None)  # the server is gone

    def submit(self, job: dict) -> queue.Queue:
        q = self.queues[job["id"]] = queue.Queue()
        with self.lock:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
        return q


_SERVER: list = []
_STARTING = threading.Lock()
_JOBS = itertools.count()


def server() -> _Server:
    """This process's server, started on first use (a few seconds: it imports torch)."""
    with _STARTING:
        if not _SERVER or _SERVER[0].proc.poll() is not None:
            _SERVER[:] = [_Server()]
        return _SERVER[0]


def live_ranks() -> list[int]:
    """The pids of this process's forked ranks still running (none, once every job has ended)."""
    from ddp_doctor.runner.processes import tree_pids

    return tree_pids(_SERVER[0].proc.pid)[1:] if _SERVER and _SERVER[0].proc.poll() is None else []


def run(argv: list[str], nproc: int, env: dict, cwd, timeout: float) -> Ended:
    """``python argv...`` on ``nproc`` forked ranks, as torchrun would run it; bounded by ``timeout`` s, every
    process ended on return (a timeout, an interrupt or a failure), where each rank was read at a timeout."""
    from ddp_doctor.runner import stacks
    from ddp_doctor.runner.processes import free_port, kill_tree, start_watchdog, tree_pids

    folder = stacks.new_folder()
    job = {"id": f"check-{os.getpid()}-{next(_JOBS)}", "nproc": nproc, "argv": [str(a) for a in argv],
           "cwd": str(cwd), "port": free_port(), "logs": [os.path.join(folder, f"out{r}.log") for r in range(nproc)],
           "env": {**os.environ, "PYTHONUNBUFFERED": "1", stacks.ENV: folder, **env}}
    srv = server()
    deadline = time.monotonic() + timeout
    codes: dict[int, int] = {}
    order: list[int] = []
    pids: list[int] = []
    watchdog = events = None
    places, stopped = "", False
    try:
        events = srv.submit(job)
        while len(codes) < nproc:
            try:
                event = events.get(timeout=max(0.01, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                event = False
            if event is None:
                raise RuntimeError("the checker's rank server ended during a check")
            if event and "pids" in event:
                pids = event["pids"]
                watchdog = start_watchdog(pids, remove=[folder])
            elif event:
                codes[event["rank"]] = event["code"]
                if event["code"]:
                    order.append(event["rank"])
            if time.monotonic() > deadline:
                stopped = True
                break
    finally:
        if events is not None and not pids:  # interrupted before the server said which processes it started
            with contextlib.suppress(queue.Empty, TypeError):
                pids = events.get(timeout=5).get("pids", [])
        left = [pid for rank, pid in enumerate(pids) if rank not in codes]
        if left:  # stopped at the timeout, or interrupted: where each rank is, then the end of every one
            if stopped:
                places = stacks.where_ranks_were(folder, stacks.ask(folder, [p for pid in left for p in tree_pids(pid)]))
            for pid in left:
                kill_tree(pid, grace=2)
            end = time.monotonic() + 5
            while len(codes) < len(pids) and time.monotonic() < end:
                try:
                    event = events.get(timeout=0.2)
                except queue.Empty:
                    continue
                if not event:
                    break
                codes.setdefault(event.get("rank", -1), event.get("code", 0))
        elif order:
            places = stacks.where_ranks_were(folder)  # a rank whose wait timed out asked the others
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()
        srv.queues.pop(job["id"], None)
        output = "".join(_tagged(rank, path) for rank, path in enumerate(job["logs"]))
        shutil.rmtree(folder, ignore_errors=True)
    returncode = None if stopped else next((codes[r] for r in order), 0)
    return Ended(returncode, output, places, order)


def _tagged(rank: int, path: str) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "".join(f"[rank{rank}]:{line}\n" for line in text.splitlines())
