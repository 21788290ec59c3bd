"""Where in the script a file was written (the doctor, ``COURSE_RECORD_TRAINING=1``): the script's own frames at
that moment, innermost first, as [file, line]: files of the script's folder (its helper modules too), not the
libraries' nor the recorder's. The doctor's rule on files written once per node reads them
(``ddp_doctor.rules_files``): a write under ``if local_rank == 0:`` is a node-local save, one elsewhere is not."""

import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the doctor's own code


def frames(script: str, limit: int = 12) -> list:
    folder = os.path.dirname(script) + os.sep
    found, frame = [], sys._getframe(1)
    while frame is not None and len(found) < limit:
        name = frame.f_code.co_filename
        if name.startswith(folder) and not name.startswith(HERE) and "site-packages" not in name:
            found.append([name, frame.f_lineno])
        frame = frame.f_back
    return found
