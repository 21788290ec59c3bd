"""The launcher's guarantees around any script's run directory: one live run at a time, and a run that
fails or is stopped never touches the previous run's results.

``launch(..., run_dir=X)`` claims X (course.rundir: atomic, a dead owner's claim taken over safely),
passes the script ``--run-dir X/in_progress`` (emptied first, except for a ``--resume`` run, which keeps
a crashed run's events there or gets the finished run's copied in, so TensorBoard's curve continues),
sets ``COURSE_STAGED=1`` (course.runlog then writes straight there), and when the job exits 0 replaces
X's previous results (events, metrics.json, every other file the run wrote) with in_progress's.
On failure or stop the previous results stay as they were; the claim is released in every case.
"""

import shutil
from pathlib import Path
from typing import ClassVar

from course.rundir import STAGING, Claim, claim_run_dir, keep_events_for_resume, publish


class StagedRun:
    """A claimed run directory with its staging folder (``staging``, what the script gets as --run-dir)."""

    ENV: ClassVar[dict[str, str]] = {"COURSE_STAGED": "1"}

    def __init__(self, run_dir: Path, args) -> None:
        self.run_dir = Path(run_dir)
        self.claim: Claim = claim_run_dir(self.run_dir)
        self.staging = self.run_dir / STAGING
        try:
            if any(str(a) == "--resume" or str(a).startswith("--resume=") for a in args):
                keep_events_for_resume(self.run_dir, self.staging)
            else:
                shutil.rmtree(self.staging, ignore_errors=True)  # a failed run's partial files, never results
                self.staging.mkdir()
        except BaseException:
            self.claim.release()
            raise

    def publish(self) -> None:
        publish(self.run_dir, self.staging)

    def release(self) -> None:
        self.claim.release()
