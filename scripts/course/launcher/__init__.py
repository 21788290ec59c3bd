"""Launch ``torchrun`` from a notebook cell: live output tagged by rank, a wall-clock timeout,
one clear message naming the failing rank, and no process left behind.

    from course.launcher import launch, show_report
    result = launch("train_ddp.py", nproc=2, args=["--epochs", "1"], run_dir="runs/03/np2")
    show_report(result)        # the full output, collapsed (a click opens it)

Why not ``!torchrun ...``? A failing ``!`` command does not fail the notebook, has no timeout,
and an interrupted cell can leave ranks behind. Here torchrun runs in its own process session;
on success, failure, timeout, Stop or cell interrupt the whole process tree is ended, and a small
watchdog process ends it too when the process that launched it dies (a killed or crashed kernel).

One module per job: ``plan`` (device, backend, threads, refusals, the command line), ``run``
(start, stream, timeout, result), ``stream`` (what the live output shows), ``torchrun_output`` (the
one reader of torchrun's output and failure report), ``processes`` (watchdog, ending trees, ports),
``rundir`` (the run directory: claimed, staged, published only on success), ``stacks`` (where each rank was: its
Python stack, dumped on request before a timed-out job is stopped, or when a rank's own wait times out).

Working directory: the repository root (what the course's scripts expect), unless ``cwd=`` says
otherwise, e.g. for a script of your own that writes relative paths.
"""

from course.launcher.plan import LaunchRefused, Plan, plan, resolve_script, torchrun_command
from course.launcher.processes import free_port, kill_tree, start_watchdog
from course.launcher.run import LaunchError, RunResult, launch, run_commands, show_report
from course.launcher.torchrun_output import (
           describe_failure,
           first_failure,
           rank_lines,
           report_entries,
           unglue,
)
from course.rundir import RunDirBusy

__all__ = ["LaunchError", "LaunchRefused", "Plan", "RunDirBusy", "RunResult", "describe_failure", "first_failure",
           "free_port", "kill_tree", "launch", "plan", "rank_lines", "report_entries", "resolve_script",
           "run_commands", "show_report", "start_watchdog", "torchrun_command", "unglue"]
