"""Launch ``torchrun`` from a notebook cell: live output tagged by rank, a wall-clock timeout,
one clear message naming the failing rank, and no process left behind.

    from course.launcher import launch, show_report
    result = launch("train_ddp.py", nproc=2, args=["--epochs", "1"], run_dir="runs/03/np2")
    show_report(result)        # the full output, collapsed (a click opens it)

Why not ``!torchrun ...``? A failing ``!`` command does not fail the notebook, has no timeout,
and an interrupted cell can leave ranks behind. Here torchrun runs in its own process session;
on success, failure, timeout, Stop or cell interrupt the whole process tree is ended, and a small
watchdog process ends it too when the process that launched it dies (a killed or crashed kernel).

The job itself is run by ``ddp_doctor.runner``, the runner the take-home doctor uses too (plan, start, stream,
timeout, the failing rank named, no orphans); its names are importable from here. The course's own part: ``run``
(``launch``: the plan's first line, a course script found by name, the repository root as working directory;
``show_report``), ``rundir`` (the run directory: claimed, staged, published only on success).

Working directory: the repository root (what the course's scripts expect), unless ``cwd=`` says
otherwise, e.g. for a script of your own that writes relative paths.
"""

from course.launcher.run import launch, resolve_script, run_commands, show_report, torchrun_command
from course.rundir import RunDirBusy
from ddp_doctor.runner import (
           LaunchError,
           LaunchRefused,
           Plan,
           RunResult,
           describe_failure,
           first_failure,
           free_port,
           kill_tree,
           plan,
           rank_lines,
           report_entries,
           start_watchdog,
           unglue,
)

__all__ = ["LaunchError", "LaunchRefused", "Plan", "RunDirBusy", "RunResult", "describe_failure", "first_failure",
           "free_port", "kill_tree", "launch", "plan", "rank_lines", "report_entries", "resolve_script",
           "run_commands", "show_report", "start_watchdog", "torchrun_command", "unglue"]
