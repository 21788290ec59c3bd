"""Errors a learner can fix, reported once: one line naming the cause, not a traceback from every rank.

    with reported_once(rank):        # before the process group starts
        train_set, val_set, n = build_datasets(...)
        check_writable(args.checkpoint)

Inside the block a CourseError (a busy run directory, a path that cannot be written) or a
course.data.DatasetError (a missing dataset; course.data imports nothing of the course, so it is not a
CourseError) makes rank 0 print ``error: <message>`` and every rank exit with status 2; the other ranks
exit quietly, so the message appears once.

``@record`` is torch's ``@record`` (a failing rank's traceback reaches torchrun's report) with one fix:
the error file appears complete or not at all. torch writes it in place; when torchrun stops a rank with
SIGTERM in the middle of that write (a second rank failing while torchrun ends the job or restarts it),
torchrun reads an empty file and itself dies with a JSONDecodeError instead of restarting.
"""

import os
import sys
from contextlib import contextmanager

EXIT_CODE = 2  # what argparse uses for bad input


class CourseError(Exception):
    """A problem with the learner's input or environment; the message says what and where."""


@contextmanager
def reported_once(rank: int = 0):
    try:
        yield
    except Exception as error:
        if not isinstance(error, (CourseError, *_dataset_errors())):
            raise
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE) from None


def _dataset_errors() -> tuple[type, ...]:
    """course.data's DatasetError, if course.data is loaded (if it is not, nothing can have raised one)."""
    data = sys.modules.get("course.data")
    return (data.DatasetError,) if data is not None else ()


def record(main):
    """Like ``torch.distributed.elastic.multiprocessing.errors.record``, with an atomic error file."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
    from torch.distributed.elastic.multiprocessing.errors import record as torch_record

    class AtomicErrorHandler(ErrorHandler):  # the documented way to customise it: subclass ErrorHandler
        writing = False

        def _get_error_file_path(self):
            path = super()._get_error_file_path()
            return f"{path}.partial" if path and self.writing else path

        def record_exception(self, e):
            final = self._get_error_file_path()
            self.writing = True
            try:
                super().record_exception(e)
            finally:
                self.writing = False
            if final and os.path.exists(f"{final}.partial"):
                os.replace(f"{final}.partial", final)

    return torch_record(main, error_handler=AtomicErrorHandler())
