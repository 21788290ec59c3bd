"""What every training run leaves behind: TensorBoard events and a metrics.json, written by rank 0 only.

    log = RunLog(run_dir, enabled=master_process)   # refuses a run directory a live run is using
    log.scalar("train/loss", loss, step)
    log.finish(val_accuracy=0.93, ...)

Nothing is lost: while a run is going, its events go to ``<run_dir>/in_progress/`` (TensorBoard shows
them live there) and the previous run's events and metrics.json stay where they are. Only ``finish()``
replaces them, so a run that crashes, is stopped or is given bad values leaves the last good results.
The run directory is claimed atomically (course.rundir): a second live run into it is refused.

Under course.launcher (``COURSE_STAGED=1``) the launcher does all that around the script: it claims the
run directory, passes ``--run-dir <run_dir>/in_progress`` and publishes on success; RunLog then writes
straight into the directory it is given.

A run resumed from a checkpoint taken at step N passes ``resume_step=N``: the crashed run's events in
``in_progress/`` are kept (or, if that run had finished, its events are copied there), and TensorBoard
hides the ones it logged after step N (``purge_step``), so the curve continues without a gap or a
repeated stretch. ``flush()`` when a checkpoint is written.
"""

import json
import os
import shutil
import time
from pathlib import Path

from course import flag, in_repo
from course.rundir import LOCK, STAGING, RunDirBusy, claim_run_dir, keep_events_for_resume, publish

__all__ = ["LOCK", "STAGING", "RunDirBusy", "RunLog"]


class RunLog:
    def __init__(self, run_dir: str | Path, enabled: bool = True, resume_step: int | None = None, **config):
        self.run_dir = in_repo(run_dir)
        self.enabled = enabled
        self.start = time.time()
        self.metrics = dict(config)
        self.loss_history: list[tuple[int, float]] = []
        self.writer = None
        self.claim = None
        self.staged = flag("COURSE_STAGED")  # the launcher claims, stages and publishes around us
        if enabled:
            if self.staged:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                events = self.run_dir
            else:
                self.claim = claim_run_dir(self.run_dir)
                events = self.run_dir / STAGING
                if resume_step is None:
                    shutil.rmtree(events, ignore_errors=True)  # a crashed run's partial events, never results
                else:
                    keep_events_for_resume(self.run_dir, events)
            from torch.utils.tensorboard import SummaryWriter  # only the process that writes pays for it

            # purge_step: TensorBoard drops this run's earlier events at steps >= it (logged after the checkpoint)
            self.writer = SummaryWriter(str(events), purge_step=None if resume_step is None else resume_step + 1)

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer:
            self.writer.add_scalar(tag, value, step)
        if tag == "train/loss":
            self.loss_history.append((step, float(value)))

    def flush(self) -> None:
        """Put the events logged so far on disk (e.g. with each checkpoint: a crash loses none of them)."""
        if self.writer:
            self.writer.flush()

    def finish(self, **results) -> dict:
        """Replace the previous results with this run's: events first, then metrics.json (atomically)."""
        self.metrics.update(results, wall_time_s=round(time.time() - self.start, 3),
                            train_loss_history=self.loss_history)
        if self.enabled:
            self.writer.close()
            folder = self.run_dir if self.staged else self.run_dir / STAGING
            tmp = folder / f"metrics.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(self.metrics, indent=2))
            os.replace(tmp, folder / "metrics.json")  # a reader never sees half a file
            if self.claim is not None:
                publish(self.run_dir, folder)
                self.claim.release()
        return self.metrics
