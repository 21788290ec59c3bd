"""Running a job: start torchrun (or several commands), stream its output live, end it on timeout, Stop
or interrupt, and return the result (or raise LaunchError naming the failing rank)."""

import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from course import ROOT, in_repo
from course.launcher import stacks
from course.launcher.plan import LaunchRefused, max_restarts, plan, resolve_script, torchrun_command
from course.launcher.processes import (
    kill_tree,
    log_folder,
    remove_orphaned_log_folders,
    start_watchdog,
    tree_pids,
)
from course.launcher.rundir import StagedRun
from course.launcher.stream import KEEP, SHOW, TorchrunStream
from course.launcher.torchrun_output import describe_failure, unglue

STARTUP = Path(__file__).parent / "startup"
RESTART_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class LaunchError(RuntimeError):
    """A launched job exited non-zero, timed out or was stopped; the message names the failing rank.

    output: everything the job printed (torchrun's own report included); failure: the short text;
    result: the RunResult (None when the job was cut short); places: where each rank was (``stacks``), or "".
    ``show_report(err)`` shows the output.
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
    places: str = ""  # where each rank was when a rank's wait timed out (course.launcher.stacks), or ""


def launch(script: str | Path, nproc: int = 1, args=(), *, backend: str = "auto", run_dir=None,
           env: dict | None = None, timeout: float = 600, check: bool = True, torchrun_args=(),
           on_line=None, stop: threading.Event | None = None, quiet: bool = False, cwd=None,
           standalone: bool = True, allow_oversubscribe: bool = False) -> RunResult:
    """Run ``script`` under torchrun with ``nproc`` processes and stream its output live.

    run_dir: the run's folder, claimed for this run (a second live run into it is refused); the script
      gets ``--run-dir <run_dir>/in_progress``, and only a run that exits 0 replaces the previous results
      (course.launcher.rundir); its metrics.json is returned in the result.
    timeout: seconds of wall time before every process is stopped and LaunchError raised; first each rank dumps
      its Python stack, and the error says where each rank was (``error.places``; course.launcher.stacks).
    check: raise LaunchError naming the failing rank and its last error lines when the job fails
      (``result.failure`` holds the same text with check=False).
    on_line: called with each output line (default: print); stop: an Event that ends the job.
    cwd: the working directory of the ranks (default: the repository root, as the course's scripts
      expect); relative paths are relative to the repository root, like run_dir.
    torchrun_args: more torchrun options; with ``--max-restarts`` > 0 the launcher sets
      TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (gloo cannot rendezvous again on the old store).
    standalone: False when ``torchrun_args`` carry the rendezvous (see ``plan.torchrun_command``).
    allow_oversubscribe: run more CPU ranks than cores instead of refusing (LaunchRefused).
    """
    chosen = plan(nproc, backend, allow_oversubscribe=allow_oversubscribe)
    if chosen.refusal:
        raise LaunchRefused(f"{chosen.refusal} (To see what it does anyway: allow_oversubscribe=True.)")
    workdir = ROOT if cwd is None else in_repo(cwd)
    if not workdir.is_dir():
        raise FileNotFoundError(f"cwd: no such folder: {workdir}")
    script_path = resolve_script(script, cwd=workdir if cwd is not None else None)
    args = [str(a) for a in args]
    torchrun_args = [str(a) for a in torchrun_args]
    job_env = chosen.env()
    restarts = max_restarts(torchrun_args) > 0
    if restarts:
        job_env[RESTART_ENV] = "1"
    job_env.update(env or {})
    plan_line = chosen.line(threads=job_env["OMP_NUM_THREADS"])  # the caller's env decides: say what runs
    if restarts:
        plan_line += f"; restarts on: {RESTART_ENV}=1 (a fresh rendezvous store for each attempt)"
    emit = on_line or _print_line
    staged = None
    if run_dir is not None:
        run_dir = in_repo(run_dir)
        staged = StagedRun(run_dir, args)  # RunDirBusy (a CourseError) if a live run holds it
        args += ["--run-dir", str(staged.staging)]
        job_env.update(StagedRun.ENV)
    log_dir = None
    try:
        if not any(a.split("=", 1)[0] in ("--log-dir", "--log_dir") for a in torchrun_args):
            # torchrun keeps per-rank logs and error files (@record) there; ours is removed after the job,
            # and a launch removes those that a killed caller left (course.launcher.processes).
            remove_orphaned_log_folders()
            log_dir = log_folder()
            torchrun_args = ["--log-dir", log_dir, *torchrun_args]
        cmd = torchrun_command(script_path, nproc, args, torchrun_args, standalone=standalone)
        if not quiet:
            emit(f"[launcher] {plan_line}\n")
            emit(f"[launcher] $ {_shell_form(cmd, log_dir)}\n")
        result = run_commands([("", cmd, job_env)], timeout=timeout, on_line=emit, stop=stop, cwd=workdir,
                              _remove=[log_dir] if log_dir else [])
        if staged is not None and result.returncode == 0:
            had_metrics = (staged.staging / "metrics.json").exists()
            staged.publish()
            if had_metrics:
                result.metrics = json.loads((run_dir / "metrics.json").read_text())
    finally:
        if log_dir:  # run_commands has read the error files it needed
            shutil.rmtree(log_dir, ignore_errors=True)
        if staged is not None:
            staged.release()
    result.run_dir = run_dir
    if not quiet:
        emit(f"[launcher] exit code {result.returncode} after {result.wall_time:.1f} s\n")
    if check and result.returncode != 0:
        raise LaunchError(f"{Path(script).name} failed (exit code {result.returncode}): {result.failure}\n"
                          "(full output: course.launcher.show_report(error), or error.output)",
                          output=result.output, failure=result.failure, result=result, places=result.places)
    return result


def run_commands(jobs, *, timeout: float = 600, on_line=None, stop: threading.Event | None = None,
                 cwd: Path = ROOT, _remove=(), where: bool = True) -> RunResult:
    """Run several commands at once (e.g. two simulated nodes), merging their output live.

    jobs: list of (label, argv, extra_env); a non-empty label prefixes each of that job's lines.
    Returns when all have exited; on timeout, stop or KeyboardInterrupt every process tree is ended,
    and a watchdog ends them if this process dies. torchrun's own failure report (its traceback and
    the ChildFailedError block) is kept in ``output`` but not streamed: ``failure`` says it in short.
    where: every rank dumps its Python stack when asked (course.launcher.stacks): at the timeout, before the
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
            # start-up code of the course's jobs only: a pause at exit against gloo's exit race (startup/sitecustomize.py)
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


def show_report(result_or_error) -> None:
    """The full output of a run (a RunResult or a LaunchError), collapsed: in a notebook an HTML
    <details> block one click away, elsewhere plain text."""
    from course.notebook import in_notebook

    output = getattr(result_or_error, "output", "") or "(no output)"
    failure = getattr(result_or_error, "failure", None)
    title = f"failed: {failure.splitlines()[0]}" if failure else "finished"
    summary = f"full output ({len(output.splitlines())} lines); {title}"
    if not in_notebook():
        print(f"---- {summary}\n{output.rstrip()}\n----")
        return
    import html

    from IPython.display import HTML, display

    display(HTML(f"<details><summary>{html.escape(summary)}</summary>"
                 f'<pre style="max-height:420px;overflow:auto;font-size:12px">{html.escape(output)}</pre>'
                 "</details>"))


def _shell_form(cmd: list[str], log_dir: str | None = None) -> str:
    shown = ["torchrun", *cmd[3:]] if cmd[1:3] == ["-m", "torch.distributed.run"] else list(cmd)
    if log_dir and log_dir in shown:  # the launcher's own temporary log folder: not the learner's concern
        at = shown.index(log_dir)
        del shown[at - 1:at + 1]
    return " ".join(shlex.quote(str(Path(c).relative_to(ROOT)) if str(c).startswith(str(ROOT) + "/") else c)
                    for c in shown)


def _print_line(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()
