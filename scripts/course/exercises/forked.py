"""The checker's ranks, started from a warm process: torch imported once, each rank a fork (Linux).

A check runs the learner's script on NPROC ranks under the recorder. Started by torchrun, every check starts three
Pythons that each import torch (torchrun's agent and two ranks; with DDP also torch._dynamo): about 7 of a check's
10 CPU-seconds on a 2-core box, before any of the learner's code runs. Here one server process per caller (a notebook
kernel, the test process) imports torch once, and each rank is a ``fork`` of it, with the environment torchrun
gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...). What the checker reads stays the same: each
rank's output tagged ``[rankN]:``, its exit code, the recorder's files, where each rank was at a timeout
(``ddp_doctor.runner.stacks``), and, as torchrun does, the other ranks stopped (SIGTERM) once one fails.

    python -m course.exercises.forked     # the server: reads jobs (JSON lines) on stdin, writes events on stdout

The server never starts a thread, so a fork of it is safe; it ends its ranks and exits when its caller goes
(stdin closes), and a watchdog per job (``ddp_doctor.runner.processes``) ends a job whose caller died. Elsewhere than
Linux (macOS forbids much after fork), for ranks on GPUs, or with COURSE_CHECK_FORK=0, the checker launches torchrun.
"""

import itertools
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.optim", "torch.nn.functional",
           "torch.utils.data", "torch.distributed.distributed_c10d")
STOP_AFTER_S = 1.0  # once a rank failed, its partners still running then are stopped (SIGTERM), as torchrun does
# after its monitor notices (0.1 s polls, slower on a busy box): a partner failing too has time to write its record
KILL_AFTER_S = 10.0  # a rank asked to stop that is still running then is killed


def usable() -> bool:
    return sys.platform == "linux" and os.environ.get("COURSE_CHECK_FORK", "1") != "0"


# ---- the server (its own process) ----

def _send(event: dict) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _rank(job: dict, rank: int, pgid: int) -> None:
    """In the forked child: become rank ``rank`` of the job, run the recorder as ``python RECORDER ARGS`` would,
    exit as Python would. Never returns."""
    code = 1
    try:
        os.setpgid(0, pgid)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(job["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 4096)  # the server's pipes: a rank holds nothing of its parent
        nproc = job["nproc"]
        os.environ.clear()
        os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                          GROUP_WORLD_SIZE="1", ROLE_NAME="rank", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(job["port"]), TORCHELASTIC_RUN_ID=job["id"], TORCHELASTIC_RESTART_COUNT="0",
                          TORCHELASTIC_MAX_RESTARTS="0")
        os.chdir(job["cwd"])
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        folder = os.environ.get("COURSE_STACKS_DIR")
        if folder:
            import _course_stacks  # ddp_doctor/runner/startup, on the server's path: where the rank is, on request

            _course_stacks.install(folder, str(rank))
        argv = job["argv"]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        import runpy

        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as error:
            code = error.code if isinstance(error.code, int) else 0 if error.code is None else 1
            if not isinstance(error.code, int | None):
                print(error.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as Python itself: the traceback, exit code 1
            sys.excepthook(*sys.exc_info())
            code = 1
        import atexit
        import threading

        threading._shutdown()  # what Python does at exit: wait for the script's own threads
        atexit._run_exitfuncs()  # the recorder's records, the exit-race pause (startup/)
    except BaseException:  # noqa: BLE001 - whatever happens, this process never returns into the server's loop
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001, S110
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if 0 <= code < 256 else 1)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's interrupt is the caller's: it ends the jobs
    ranks: dict[int, tuple[str, int]] = {}  # pid -> (job, rank)
    stopping: dict[int, float] = {}  # pid -> when it was asked to stop
    failed: dict[str, float] = {}  # job -> when its first rank failed
    _send({"ready": os.getpid(), "threads": len(os.listdir("/proc/self/task"))})
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:  # the caller is gone: so are its jobs
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pids = []
                for rank in range(job["nproc"]):
                    pid = os.fork()
                    if pid == 0:
                        _rank(job, rank, pids[0] if pids else 0)
                    try:
                        os.setpgid(pid, pids[0] if pids else pid)
                    except OSError:  # it already did, or has ended
                        pass
                    pids.append(pid)
                    ranks[pid] = (job["id"], rank)
                _send({"job": job["id"], "pids": pids})
        while ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            job, rank = ranks.pop(pid)
            stopping.pop(pid, None)
            code = _exit_code(status)
            _send({"job": job, "rank": rank, "code": code, "t": time.time()})
            if code != 0:
                failed.setdefault(job, time.monotonic())
        for job, since in list(failed.items()):  # as torchrun: once a rank fails, the others are stopped
            if time.monotonic() - since > STOP_AFTER_S:
                for other, (j, _) in ranks.items():
                    if j == job and other not in stopping:
                        _signal(other, signal.SIGTERM)
                        stopping[other] = time.monotonic()
                del failed[job]
        for pid, since in list(stopping.items()):
            if time.monotonic() - since > KILL_AFTER_S:
                _signal(pid, signal.SIGKILL)
                del stopping[pid]
    for pid in ranks:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


# ---- the caller's side ----

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
        self.proc = subprocess.Popen([sys.executable, "-m", "course.exercises.forked"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                     start_new_session=True)  # an interrupt of the caller's group is the caller's
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

    def _read(self, ready: queue.Queue) -> None:
        for line in self.proc.stdout:
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
            self.proc.stdin.flush()
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
    events = srv.submit(job)
    deadline = time.monotonic() + timeout
    codes: dict[int, int] = {}
    order: list[int] = []
    pids: list[int] = []
    watchdog = None
    places, stopped = "", False
    try:
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


if __name__ == "__main__":
    serve()
