"""argparse types that reject bad values with one line, and paths that do not depend on the working directory;
and ``JobParser``, an ArgumentParser that reports bad input once per torchrun job (rank 0).

    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--seed", type=seed, default=0)                            # torch's range
    parser.add_argument("--run-dir", type=output_dir, default="runs/train_lm")     # a probe file written now
    parser.add_argument("--save", type=writable_file, default="weights/lm.pt")   # '' for none
    check_gpt_size(parser, args, data)       # "needs about X GB, this machine has Y GB", before the group

Every output flag is checked here, before any process group: its folder exists or can be created, and a probe
file can be created and removed in it (course.train_utils.check_folder).
"""

import argparse
import os
import time
from pathlib import Path

from course import in_repo
from course.errors import QUIET_EXIT_AFTER_S

# the take-home scripts' own checks, one copy (seed and SEED_MAX are imported from here too)
from course.train_utils import SEED_MAX, CourseError, check_folder, check_writable, number, seed, too_big  # noqa: F401


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


def output_dir(text: str) -> str:
    """A folder the run will write into (--run-dir, a DCP --save), relative to the working directory: probed with a
    file now (in it, or in the nearest folder above it that exists: nothing is created), rather than refused after
    the process group started or after training."""
    try:
        check_folder(Path(text).expanduser(), "", create=False)
    except CourseError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def repo_output_dir(text: str) -> Path:
    """output_dir for a path taken from the course's root folder (repo_path)."""
    return Path(output_dir(str(in_repo(text))))


def writable_file(text: str) -> str:
    """A file the run will write at its end ('' for none), refused now rather than after training: a path that
    is a folder, one below a file, or in a folder that takes no new file (probed). Relative to the working
    directory, as the script will write it."""
    if not text:
        return text
    try:
        check_writable(Path(text).expanduser(), "")
    except CourseError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def repo_writable_file(text: str) -> Path:
    """writable_file for a path taken from the course's root folder (repo_path); '' for none."""
    return Path(writable_file(str(in_repo(text)))) if text else text


LM_SEED_MAX = (2**64 - 1) // 100_003 - 1_000  # course.lm_data seeds its shuffles with seed * 100_003 + epoch


def lm_seed(text: str) -> int:
    """--seed of the language-model scripts: torch's range, less what course.lm_data multiplies it by."""
    return number(int, 0, strict=False, high=LM_SEED_MAX)(text)


def gpt_bytes(n_layer: int, n_embd: int, n_head: int, vocab: int, block: int, batch: int, shards: int = 1) -> float:
    """About how many bytes training course.gpt's GPT takes on one process: parameters, gradients and AdamW's
    two moments (16 bytes a parameter, split over ``shards``), and the activations backward keeps (fp32)."""
    params = 12 * n_layer * n_embd * n_embd + (2 * vocab + block) * n_embd
    activations = batch * block * (n_layer * (16 * n_embd + 3 * n_head * block) + 3 * vocab)
    return 16 * params / shards + 4 * activations


def check_size(parser, flags: str, needed: float) -> None:
    """parser.error naming ``flags`` when ``needed`` bytes do not fit this machine's memory."""
    if (why := too_big(needed)) is not None:
        parser.error(f"argument {flags}: {why}")


def check_gpt_size(parser, args, data, shards: int = 1) -> None:
    """check_size for the language-model scripts: --n-layer, --n-embd, --batch-size on ``data``'s vocabulary."""
    n_embd, n_head = getattr(args, "n_embd", 64), getattr(args, "n_head", 4)  # course.gpt's defaults
    needed = gpt_bytes(args.n_layer, n_embd, n_head, data.vocab_size, data.block_size, args.batch_size, shards)
    check_size(parser, f"--n-layer {args.n_layer}, --n-embd {n_embd}, --batch-size {args.batch_size}", needed)


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

    def parse_args(self, args=None, namespace=None):
        """As argparse's, and a --run-dir that a live run holds is refused here, on every rank, before any
        process group (under the course launcher, which claims it itself, there is nothing to look at)."""
        from course.rundir import live_owner

        parsed = super().parse_args(args, namespace)
        run_dir = getattr(parsed, "run_dir", None)
        staged = os.environ.get("COURSE_STAGED", "0") not in ("", "0")
        if run_dir is not None and not staged and (owner := live_owner(in_repo(run_dir))):
            self.error(f"argument --run-dir: {run_dir} is in use by a live run ({owner}); wait for it, stop it, "
                       "or pass another --run-dir")
        return parsed

    def error(self, message):
        if os.environ.get("RANK", "0") != "0":
            time.sleep(self.quiet_exit_after_s)
            self.exit(2)
        super().error(message)
