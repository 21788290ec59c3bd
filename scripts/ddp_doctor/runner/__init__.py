"""Run a torchrun job (or several commands at once) from Python: output tagged by rank and streamed live, a
wall-clock timeout, one clear message naming the failing rank, and no process left behind.

    from ddp_doctor.runner import plan, run_commands, torchrun_command
    chosen = plan(2)                                        # device, backend, threads per rank, refusals
    result = run_commands([("", torchrun_command("train.py", 2), chosen.env())], timeout=300)

torchrun runs in its own process session; on success, failure, timeout, stop or interrupt the whole process tree
is ended, and a small watchdog process ends it too when the process that started it dies.

One module per job: ``plan`` (device, backend, threads, refusals, the command line), ``run`` (start, stream,
timeout, result), ``stream`` (what the live output shows), ``torchrun_output`` (the one reader of torchrun's output
and failure report), ``processes`` (watchdog, ending trees, ports; ``procinfo`` where psutil is not installed),
``stacks`` (where each rank was: its Python stack, dumped on request before a timed-out job is stopped, or when a
rank's own wait times out), ``startup/`` (what every process of a job imports at start-up).
"""

from ddp_doctor.runner.plan import LaunchRefused, Plan, plan, torchrun_command
from ddp_doctor.runner.processes import free_port, kill_tree, start_watchdog
from ddp_doctor.runner.run import LaunchError, RunResult, run_commands
from ddp_doctor.runner.torchrun_output import (
           describe_failure,
           first_failure,
           rank_lines,
           report_entries,
           unglue,
)

__all__ = ["LaunchError", "LaunchRefused", "Plan", "RunResult", "describe_failure", "first_failure", "free_port",
           "kill_tree", "plan", "rank_lines", "report_entries", "run_commands", "start_watchdog", "torchrun_command",
           "unglue"]
