"""Errors a learner can fix, reported once: one line naming the cause, not a traceback from every rank.

    with reported_once(rank):        # before the process group starts
        train_set, val_set, n = build_datasets(...)
        check_writable(args.checkpoint)

Inside the block a CourseError (a missing dataset, a busy run directory, a path that cannot be
written) makes rank 0 print ``error: <message>`` and every rank exit with status 2; the other ranks
exit quietly, so the message appears once.
"""

import sys
from contextlib import contextmanager

EXIT_CODE = 2  # what argparse uses for bad input


class CourseError(Exception):
    """A problem with the learner's input or environment; the message says what and where."""


@contextmanager
def reported_once(rank: int = 0):
    try:
        yield
    except CourseError as error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE) from None
