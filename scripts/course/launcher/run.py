"""A launch from a notebook cell: the plan's first line, a course script's run directory claimed and published
only on success, the job run by ``ddp_doctor.runner`` (start, stream, timeout, the failing rank named), and the
full output one click away (``show_report``)."""

import json
import shlex
import shutil
import sys
import threading
from pathlib import Path

from course import ROOT, SCRIPTS, in_repo
from course.launcher.rundir import StagedRun
from ddp_doctor.runner.plan import LaunchRefused, max_restarts, plan
from ddp_doctor.runner.plan import torchrun_command as any_torchrun_command
from ddp_doctor.runner.processes import log_folder, remove_orphaned_log_folders
from ddp_doctor.runner.run import LaunchError, RunResult
from ddp_doctor.runner.run import run_commands as run_anywhere

RESTART_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def launch(script: str | Path, nproc: int = 1, args=(), *, backend: str = "auto", run_dir=None,
           env: dict | None = None, timeout: float = 600, check: bool = True, torchrun_args=(),
           on_line=None, stop: threading.Event | None = None, quiet: bool = False, cwd=None,
           standalone: bool = True, allow_oversubscribe: bool = False) -> RunResult:
    """Run ``script`` under torchrun with ``nproc`` processes and stream its output live.

    run_dir: the run's folder, claimed for this run (a second live run into it is refused); the script
      gets ``--run-dir <run_dir>/in_progress``, and only a run that exits 0 replaces the previous results
      (course.launcher.rundir); its metrics.json is returned in the result.
    timeout: seconds of wall time before every process is stopped and LaunchError raised; first each rank dumps
      its Python stack, and the error says where each rank was (``error.places``; ddp_doctor.runner.stacks).
    check: raise LaunchError naming the failing rank and its last error lines when the job fails
      (``result.failure`` holds the same text with check=False).
    on_line: called with each output line (default: print); stop: an Event that ends the job.
    cwd: the working directory of the ranks (default: the repository root, as the course's scripts
      expect); relative paths are relative to the repository root, like run_dir.
    torchrun_args: more torchrun options; with ``--max-restarts`` > 0 the launcher sets
      TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (gloo cannot rendezvous again on the old store).
    standalone: False when ``torchrun_args`` carry the rendezvous (see ``ddp_doctor.runner.plan.torchrun_command``).
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
            # and a launch removes those that a killed caller left (ddp_doctor.runner.processes).
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


def run_commands(jobs, *, cwd=None, **options) -> RunResult:
    """``ddp_doctor.runner.run_commands`` (several commands at once, output merged live, bounded, no process left
    behind), working in the repository root unless ``cwd`` says otherwise, as the course's scripts expect."""
    return run_anywhere(jobs, cwd=ROOT if cwd is None else cwd, **options)


def torchrun_command(script: str | Path, nproc: int, args=(), torchrun_args=(), standalone: bool = True) -> list[str]:
    """``ddp_doctor.runner.torchrun_command`` for a script named as the course names them (``resolve_script``)."""
    return any_torchrun_command(resolve_script(script), nproc, args, torchrun_args, standalone)


def resolve_script(script: str | Path, cwd=None) -> Path:
    """A script name as given (relative to ``cwd`` if given, else to the working directory), else
    relative to the repository, else to scripts/."""
    places = ([Path(cwd) / script] if cwd is not None else []) + [Path(script), ROOT / script, SCRIPTS / script]
    for path in places:
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(f"no such script: {script} (looked here, in {ROOT} and in {SCRIPTS})")


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
