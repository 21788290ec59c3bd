"""What every training run leaves behind: TensorBoard events and a metrics.json, written by rank 0 only.

    log = RunLog(run_dir, enabled=master_process)   # refuses a run directory a live run is using
    log.scalar("train/loss", loss, step)
    log.finish(val_accuracy=0.93, ...)

Nothing is lost: while a run is going, its events go to ``<run_dir>/in_progress/`` (TensorBoard shows
them live there) and the previous run's events and metrics.json stay where they are. Only ``finish()``
replaces them, so a run that crashes, is stopped or is given bad values leaves the last good results.

A run resumed from a checkpoint taken at step N passes ``resume_step=N``: the crashed run's events in
``in_progress/`` are kept (or, if that run had finished, its events are copied there), and TensorBoard hides the ones it logged after step N (``purge_step``), so the
curve continues without a gap or a repeated stretch. ``flush()`` when a checkpoint is written.
"""

import json
import os
import shutil
import socket
import time
from pathlib import Path

from course import in_repo
from course.errors import CourseError

LOCK = ".lock"
STAGING = "in_progress"


class RunDirBusy(CourseError):
    """Another live run is writing into the same run directory."""


class RunLog:
    def __init__(self, run_dir: str | Path, enabled: bool = True, resume_step: int | None = None, **config):
        self.run_dir = in_repo(run_dir)
        self.enabled = enabled
        self.start = time.time()
        self.metrics = dict(config)
        self.loss_history: list[tuple[int, float]] = []
        self.writer = None
        if enabled:
            self._lock()
            staging = self.run_dir / STAGING
            if resume_step is None:
                shutil.rmtree(staging, ignore_errors=True)  # a crashed run's partial events, never results
            elif not any(staging.glob("events.out.tfevents.*")):  # resuming a run that had finished: its events
                staging.mkdir(exist_ok=True)                      # continue too (finish() replaces the old ones)
                for done in self.run_dir.glob("events.out.tfevents.*"):
                    shutil.copy2(done, staging / done.name)
            from torch.utils.tensorboard import SummaryWriter  # only the process that writes pays for it

            # purge_step: TensorBoard drops this run's earlier events at steps >= it (logged after the checkpoint)
            self.writer = SummaryWriter(str(staging), purge_step=None if resume_step is None else resume_step + 1)

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
            staging = self.run_dir / STAGING
            for old in self.run_dir.glob("events.out.tfevents.*"):
                old.unlink()
            for new in staging.glob("events.out.tfevents.*"):
                new.rename(self.run_dir / new.name)
            shutil.rmtree(staging, ignore_errors=True)
            tmp = self.run_dir / f"metrics.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(self.metrics, indent=2))
            os.replace(tmp, self.run_dir / "metrics.json")  # a reader never sees half a file
            self._unlock()
        return self.metrics

    def _lock(self) -> None:
        """Claim the run directory; a lock left by a process that no longer exists is taken over."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / f".probe.{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as error:
            raise CourseError(f"cannot write the run directory {self.run_dir}: {error.strerror}") from None
        lock = self.run_dir / LOCK
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                owner = lock.read_text().strip() if lock.exists() else ""
                if owner != me and _alive(owner):
                    raise RunDirBusy(f"run directory {self.run_dir} is in use by a live run ({owner}); "
                                     "wait for it, stop it, or pass another --run-dir") from None
                lock.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            return
        raise RunDirBusy(f"could not claim run directory {self.run_dir}; another run is starting there")

    def _unlock(self) -> None:
        (self.run_dir / LOCK).unlink(missing_ok=True)


def _alive(owner: str) -> bool:
    host, _, pid = owner.rpartition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return bool(owner) and host != socket.gethostname()  # another machine's lock: assume live
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
