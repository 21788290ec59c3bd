"""The checker's rank server (``course.exercises.forked`` starts one per caller): it imports torch once, then
makes each rank of a job a ``fork`` of itself, with the environment torchrun gives a rank.

    python -m course.rank_server     # reads jobs (JSON lines) on stdin, writes events (JSON lines) on stdout

A job: ``{"id", "nproc", "argv", "env", "cwd", "port", "logs"}``; its events: ``{"job", "pids"}`` once its ranks are
started, then ``{"job", "rank", "code", "t"}`` as each ends. Each rank runs ``python ARGV...`` as Python would (as
``__main__``, exit code and traceback as Python gives them), its output in its log file, in a process group of the
job's. As torchrun does, once a rank fails the job's other ranks are stopped (SIGTERM), here after ``STOP_AFTER_S``.
It never starts a thread (a fork of it is safe), imports nothing of the course, and when its input closes (its caller
is gone) it kills its ranks and exits.
"""

import json
import os
import select
import signal
import sys
import time

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.optim", "torch.nn.functional",
           "torch.utils.data", "torch.distributed.distributed_c10d")
STOP_AFTER_S = 1.0  # once a rank failed, its partners still running then are stopped (SIGTERM), as torchrun does
# after its monitor notices (0.1 s polls, slower on a busy box): a partner failing too has time to write its record
KILL_AFTER_S = 10.0  # a rank asked to stop that is still running then is killed

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



if __name__ == "__main__":
    serve()
