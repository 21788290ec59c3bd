"""Errors a learner can fix, reported once: one line naming the cause, not a traceback from every rank.

    with reported_once(rank):        # before the process group starts
        train_set, val_set, n = build_datasets(...)
        check_writable(args.checkpoint)

Inside the block a CourseError (a path that cannot be written), a run directory that cannot be used
(ddp_doctor.rundir's RunDirError: busy, or not writable) or a
course.data.DatasetError (a missing dataset; course.data imports nothing of the course, so it is not a
CourseError) makes rank 0 print ``error: <message>`` and every rank exit with status 2; the other ranks
exit quietly a few seconds later (torchrun stops the job when the first process exits), so the message appears once.

``CourseError`` and ``record`` (torch's ``@record`` with an atomic error file) live in course.train_utils, which
the take-home scripts import and a learner copies; they are importable from here too.
"""

import sys
import time
from contextlib import contextmanager

from course.train_utils import CourseError, record  # noqa: F401 (their home is course.train_utils)
from ddp_doctor.rundir import RunDirError

EXIT_CODE = 2  # what argparse uses for bad input
QUIET_EXIT_AFTER_S = 5.0  # what the ranks other than 0 wait before they exit after bad input


@contextmanager
def reported_once(rank: int = 0):
    try:
        yield
    except Exception as error:
        if not isinstance(error, (CourseError, RunDirError, *_dataset_errors())):
            raise
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        else:  # torchrun stops the whole job as soon as one process exits: rank 0 must have printed by then
            time.sleep(QUIET_EXIT_AFTER_S)
        raise SystemExit(EXIT_CODE) from None


def _dataset_errors() -> tuple[type, ...]:
    """course.data's DatasetError, if course.data is loaded (if it is not, nothing can have raised one)."""
    data = sys.modules.get("course.data")
    return (data.DatasetError,) if data is not None else ()
