"""argparse types that reject bad values with one line, and paths that do not depend on the working directory;
and ``JobParser``, an ArgumentParser that reports bad input once per torchrun job (rank 0).

    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--run-dir", type=repo_path, default="runs/train_ddp")
    parser.add_argument("--save", type=writable_file, default="weights/lm.pt")   # '' for none
"""

import argparse
import os
import time
from pathlib import Path

from course import in_repo
from course.errors import QUIET_EXIT_AFTER_S
from course.train_utils import number  # the take-home scripts' own check, one copy


def positive_int(text: str) -> int:
    """An integer > 0 (epochs, batch size, steps between logs)."""
    return number(int, 0)(text)


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (workers; max-steps, where 0 means no limit)."""
    return number(int, 0, strict=False)(text)


def positive_float(text: str) -> float:
    """A number > 0 (learning rate)."""
    return number(float, 0.0)(text)


def repo_path(text: str) -> Path:
    """A path; a relative one is taken from the course's root folder, whatever the working directory."""
    return in_repo(text)


def writable_file(text: str) -> str:
    """A file the run will write at its end ('' for none), refused now rather than after training: a path that
    is a folder, or one below a file. Relative to the working directory, as the script will write it."""
    if not text:
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {blocker} is a file, not a folder")
    return text


class JobParser(argparse.ArgumentParser):
    """argparse for a script that every process of a torchrun job runs: bad input is reported by rank 0 alone
    (``usage:`` and one ``error: ...`` line) and every process exits with argparse's status 2, so the job says
    it once. The other ranks wait a few seconds before they exit: torchrun stops the whole job as soon as one
    process exits, and rank 0 must have printed by then. A process outside torchrun (no RANK) is rank 0.
    Checks between flags and the world size go through ``parser.error`` too, before any process group:

        parser = JobParser(description=__doc__)
        parser.add_argument("--n-head", type=positive_int, default=4)
        args = parser.parse_args()
        if args.n_head % world_size:
            parser.error(f"argument --n-head: {args.n_head} heads do not split over {world_size} processes")
    """

    quiet_exit_after_s = QUIET_EXIT_AFTER_S  # what the other ranks wait before they exit

    def world_size(self) -> int:
        """The number of processes, as torchrun sets it (WORLD_SIZE); outside torchrun, one error line saying
        how to launch the script."""
        if "WORLD_SIZE" not in os.environ or "LOCAL_RANK" not in os.environ:
            self.error(f"no torchrun environment (WORLD_SIZE, LOCAL_RANK): launch it with "
                       f"torchrun --nproc-per-node=N {self.prog}")
        return int(os.environ["WORLD_SIZE"])

    def error(self, message):
        if os.environ.get("RANK", "0") != "0":
            time.sleep(self.quiet_exit_after_s)
            self.exit(2)
        super().error(message)
