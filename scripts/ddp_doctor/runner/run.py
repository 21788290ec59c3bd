"""Running a job: start torchrun (or several commands), stream its output live, end it on timeout, Stop
or interrupt, and return the result (or raise LaunchError naming the failing rank)."""

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_doctor.runner import stacks
from ddp_doctor.runner.processes import kill_tree, start_watchdog, tree_pids
from ddp_doctor.runner.stream import KEEP, SHOW, TorchrunStream
from ddp_doctor.runner.torchrun_output import describe_failure, unglue

STARTUP = Path(__file__).parent / "startup"


class LaunchError(RuntimeError):
    """A launched job exited non-zero, timed out or was stopped; the message names the failing rank.

    output: everything the job printed (torchrun's own report included); failure: the short text;
    result: the RunResult (None when the job was cut short); places: where each rank was (``stacks``), or "".
    """

    def __init__(self, message: str, *, output: str = "", failure: str | None = None, result=None, places: str = ""):
        super().__init__(message)
        self.output, self.failure, self.result, self.places = output, failure or message, result, places


@dataclass
class RunResult:
    returncode: int
    wall_time: float
    output: str
    run_dir: Path | None = None
    metrics: dict | None = None
    returncodes: list[int] = field(default_factory=list)
    failure: str | None = None  # on failure: the first failing rank and its cause
    places: str = ""  # where each rank was when a rank's wait timed out (ddp_doctor.runner.stacks), or ""


def run_commands(jobs, *, timeout: float = 600, on_line=None, stop: threading.Event | None = None,
                 cwd=None, _remove=(), where: bool = True) -> RunResult:
    """Run several commands at once (e.g. two simulated nodes), merging their output live.

    jobs: list of (label, argv, extra_env); a non-empty label prefixes each of that job's lines; cwd: their working
    folder (default: this process's).
    Returns when all have exited; on timeout, stop or KeyboardInterrupt every process tree is ended,
    and a watchdog ends them if this process dies. torchrun's own failure report (its traceback and
    the ChildFailedError block) is kept in ``output`` but not streamed: ``failure`` says it in short.
    where: every rank dumps its Python stack when asked (``stacks``): at the timeout, before the
    job is stopped, the error says where each rank was; when a rank's own wait times out, the failure says where
    the other ranks were (False: a caller that records it otherwise, the doctor's recorder).
    """
    emit = on_line or _print_line
    lines: queue.Queue = queue.Queue()
    procs, captured = [], []
    start = time.monotonic()
    reason = None
    watchdog = None
    open_streams = 0  # output pumps still running
    folder = stacks.new_folder() if where else None  # each rank's stack, when asked
    remove = [*_remove, folder] if folder else list(_remove)
    places = ""

    def take(wait: float) -> None:
        """Show and keep the next line, if one comes within ``wait`` s; count the streams that close."""
        nonlocal open_streams
        try:
            item = lines.get(timeout=wait)
        except queue.Empty:
            return
        if item is None:
            open_streams -= 1
            return
        line, how = item
        if how != SHOW:
            captured.append(line)
        if how != KEEP:
            emit(line)

    try:
        for label, argv, extra_env in jobs:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
            # start-up code of the runner's jobs only: a pause at exit against gloo's exit race (startup/sitecustomize.py)
            env["PYTHONPATH"] = os.pathsep.join([str(STARTUP), *filter(None, [env.get("PYTHONPATH")])])
            env[stacks.ENV] = folder or ""
            # Own session: a notebook interrupt (SIGINT to the kernel's group) reaches us, not the ranks,
            # so that we, not a half-delivered signal, decide how they end.
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                                    errors="replace", bufsize=1)
            procs.append(proc)
            prefix = f"[{label}] " if label else ""
            threading.Thread(target=_pump, args=(proc, prefix, lines), daemon=True).start()
            open_streams += 1
        watchdog = start_watchdog([p.pid for p in procs], remove=remove)
        while open_streams:
            take(0.1)
            if time.monotonic() - start > timeout:
                reason = f"timed out after {timeout:.0f} s"
                break
            if stop is not None and stop.is_set():
                reason = "stopped"
                break
        if reason is None:
            for proc in procs:
                proc.wait()  # every stream is closed, so this returns at once
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    finally:
        if reason is not None:
            if folder and reason.startswith("timed out"):  # where each rank is, before anything is stopped
                asked = stacks.ask(folder, [pid for p in procs for pid in tree_pids(p.pid)])
                places = stacks.where_ranks_were(folder, asked)
                for line in places.splitlines():
                    emit(f"[launcher] {line}\n")
            ended = sum(kill_tree(p.pid) for p in procs)
            # What the processes wrote before they ended may still be in the pipes (torchrun copies its
            # ranks' log files to its stdout as it stops): keep it, it can say why the job was stopped.
            deadline = time.monotonic() + 5
            while open_streams and time.monotonic() < deadline:
                take(0.1)
            emit(f"[launcher] {reason}: ended {ended} process(es)\n")
        if watchdog is not None:
            watchdog.kill()  # the job is over (or ended above): nothing left to watch
            watchdog.wait()
        codes = [p.returncode for p in procs]
        if folder and reason is None and any(codes):  # a rank whose wait timed out asked the others
            places = stacks.where_ranks_were(folder)
        for path in remove:  # whoever ends the job removes its folders
            shutil.rmtree(path, ignore_errors=True)
    output = "".join(captured)
    more = f"\n{places}" if places else ""
    if reason is not None:
        raise LaunchError(f"job {reason}; every process was ended (its output is above).{more}", output=output,
                          failure=f"job {reason}{more}", places=places)
    code = next((c for c in codes if c != 0), 0)
    return RunResult(returncode=code, wall_time=time.monotonic() - start, output=output, returncodes=codes,
                     failure=describe_failure(output, code) + more if code else None, places=places)


def _pump(proc: subprocess.Popen, prefix: str, lines: queue.Queue) -> None:
    stream = TorchrunStream()
    for line in proc.stdout:
        for text, how in (item for part in unglue(line) for item in stream.feed(part)):
            lines.put((prefix + text, how))
    for text, how in stream.flush():
        lines.put((prefix + text, how))
    proc.stdout.close()
    proc.wait()
    lines.put(None)


def _print_line(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()
