"""The course's run directories: one live run per run directory (an atomic claim), results replaced all at once.
The claim and the publishing are ``ddp_doctor.rundir``'s (the doctor claims its folders the same way), imported
here for the course's scripts; a resumed run's TensorBoard events are the course's own (``keep_events_for_resume``).

    claim = claim_run_dir(run_dir)      # RunDirBusy if a live run holds it
    ...                                  # the run writes into run_dir/in_progress
    publish(run_dir, run_dir / STAGING)  # its results replace the previous ones (only on success)
    claim.release()

Used by course.runlog (plain torchrun) and by course.launcher (around any script); imports nothing heavy.
"""

import shutil
from pathlib import Path

from ddp_doctor.rundir import (  # noqa: F401 (the course's scripts import them from here)
    EVENTS,
    LOCK,
    METRICS,
    STAGING,
    Claim,
    RunDirBusy,
    RunDirError,
    claim_run_dir,
    live_owner,
    owner_text,
    publish,
)


def keep_events_for_resume(run_dir: Path, staging: Path) -> None:
    """Resuming: the staged events of a crashed run stay; if there are none (the run had finished), the
    finished run's events are copied in, so that TensorBoard's curve continues."""
    staging.mkdir(parents=True, exist_ok=True)
    if not any(staging.glob(EVENTS)):
        for done in run_dir.glob(EVENTS):
            shutil.copy2(done, staging / done.name)
