"""Configurations of the course's scripts launched in alternating rounds, for course.measure.compare, with what
every round wrote kept (notebooks 01 and 03). The plumbing of a comparison, out of the lesson's cells.

    rounds = Rounds("runs/03_ddp_five_steps")
    rounds.add("2 ranks", "train_ddp.py", args, nproc=2, env={"OMP_NUM_THREADS": "1"}, name="mnist/np2")
    rounds.add("python", "train_single.py", args, python=True, name="mnist_python")  # plain python, no torchrun
    speed = compare(rounds.measures(), repeats=5, unit="samples/s")   # A B A B ...: samples/s of each round
    rounds.metrics["2 ranks"]           # the metrics.json of every round of that configuration, in order
    metrics = run("ddp_gradients.py", 2, ["--models", "mlp"], "runs/03_ddp_five_steps/gradients")  # one run

A launch's output stays out of the notebook (a failure still raises, with the failing rank's error) unless the
configuration asks to show its first round.
"""

from __future__ import annotations

import json
import sys

from course import SCRIPTS, in_repo
from course.launcher import launch, run_commands


def run(script: str, nproc: int, args, run_dir, env: dict | None = None, show_output: bool = False,
        timeout: float = 900) -> dict:
    """Launch ``script`` with torchrun on ``nproc`` processes into ``run_dir``; its metrics.json."""
    result = launch(script, nproc=nproc, args=args, run_dir=run_dir, env=env, timeout=timeout,
                    quiet=not show_output, on_line=None if show_output else (lambda line: None))
    return result.metrics


def run_with_python(script: str, args, run_dir, env: dict | None = None, timeout: float = 900) -> dict:
    """``python script ...`` (one process, no torchrun) into ``run_dir``; its metrics.json."""
    command = [sys.executable, str(SCRIPTS / script), *map(str, args), "--run-dir", str(in_repo(run_dir))]
    result = run_commands([("", command, env or {})], timeout=timeout, on_line=lambda line: None)
    if result.returncode != 0:
        raise RuntimeError(f"{script} exited with {result.returncode}:\n{result.output[-2000:]}")
    return json.loads((in_repo(run_dir) / "metrics.json").read_text())


class Rounds:
    """Named configurations; each call of a measure launches one round of one configuration."""

    def __init__(self, root):
        self.root = root
        self.configs: dict[str, dict] = {}
        self.metrics: dict[str, list[dict]] = {}

    def add(self, label: str, script: str, args, *, name: str, nproc: int = 1, env: dict | None = None,
            python: bool = False, show_first: bool = False) -> None:
        """A configuration: ``script`` with ``args`` on ``nproc`` processes (or plain python), into root/name."""
        self.configs[label] = {"script": script, "args": list(args), "name": name, "nproc": nproc, "env": env,
                               "python": python, "show_first": show_first}
        self.metrics[label] = []

    def once(self, label: str) -> dict:
        """One round of one configuration: its metrics.json, also kept in ``metrics[label]``."""
        c = self.configs[label]
        run_dir = f"{self.root}/{c['name']}"
        show = c["show_first"] and not self.metrics[label]
        if show:
            print(f"--- {label}: the first round, in full ---")
        if c["python"]:
            metrics = run_with_python(c["script"], c["args"], run_dir, env=c["env"])
        else:
            metrics = run(c["script"], c["nproc"], c["args"], run_dir, env=c["env"], show_output=show)
        if show:
            print("--- the other rounds are quiet; their numbers follow ---")
        self.metrics[label].append(metrics)
        return metrics

    def measures(self, key: str = "samples_per_s") -> dict:
        """{label: a function that runs one round and returns metrics[key]}, for course.measure.compare."""
        return {label: (lambda label=label: self.once(label)[key]) for label in self.configs}
