"""Claiming a run directory (one live run at a time) and replacing its results all at once.

    claim = claim_run_dir(run_dir)      # RunDirBusy if a live run holds it
    ...                                  # the run writes into run_dir/in_progress
    publish(run_dir, run_dir / STAGING)  # its results replace the previous ones (only on success)
    claim.release()

The claim is atomic: ``.lock`` appears with its owner already in it (a private temporary file, locked
with ``flock``, is hard-linked into place), and it is held by an OS lock on the open file, which the
system drops when the owner dies, however it dies. A lock whose owner is gone is taken over by renaming
a new locked file over it, and only by a claimant that holds the old file's OS lock and has checked
that the path still names that file: so two claimants never both win. Used by the doctor (its folder for a script:
one doctor at a time) and by the course's run directories (course.rundir); imports nothing heavy.
"""

import fcntl
import os
import shutil
import socket
from pathlib import Path

LOCK = ".lock"
STAGING = "in_progress"
METRICS = "metrics.json"
EVENTS = "events.out.tfevents.*"


class RunDirError(Exception):
    """A run directory that cannot be used: it cannot be written, or a live run holds it (``RunDirBusy``)."""


class RunDirBusy(RunDirError):
    """Another live run is writing into the same run directory."""


class Claim:
    """A held run directory; ``release()`` (or leaving a ``with`` block) gives it up."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd = run_dir, fd

    def release(self) -> None:
        if self.fd is None:
            return
        (self.run_dir / LOCK).unlink(missing_ok=True)  # while still holding it: nobody else changes the path
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.release()


def _job_line() -> str:
    """The torchrun job this process belongs to (torchrun's run id: a fresh uuid with --standalone), or ''."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"job {job}" if job else ""


def owner_text() -> str:
    """What a claim writes into ``.lock``: "host pid" (what an error shows), then the claimant's torchrun job."""
    return f"{socket.gethostname()} {os.getpid()}\n{_job_line()}".strip()


def _shown(text: str) -> str:
    return text.strip().split("\n")[0].strip() or "another process"


def live_owner(run_dir: str | os.PathLike) -> str | None:
    """Who holds ``run_dir`` now (a live run's owner text), or None: a look before a job starts, so that every
    rank can refuse a busy run directory with one line before any process group (the claim stays the guard).
    A claim by a rank of this same torchrun job is not another run: None (its other ranks look after it claimed)."""
    try:
        theirs = os.open(Path(run_dir) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(theirs, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(theirs, fcntl.LOCK_UN)
        return None  # a lock left by a run that is gone
    except BlockingIOError:
        text = os.pread(theirs, 200, 0).decode(errors="replace")
        if _job_line() and _job_line() in text.split("\n")[1:]:
            return None  # our own job's claim
        return _shown(text)
    finally:
        os.close(theirs)


def claim_run_dir(run_dir: str | os.PathLike, attempts: int = 50) -> Claim:
    """Claim ``run_dir`` (created if needed) for this process; RunDirBusy if a live run holds it."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".probe.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise RunDirError(f"cannot write the run directory {run_dir}: {error.strerror}") from None
    lock = run_dir / LOCK
    tmp = run_dir / f"{LOCK}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    mine = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(mine, owner_text().encode())
        fcntl.flock(mine, fcntl.LOCK_EX | fcntl.LOCK_NB)  # private: nobody else can hold it
        for _ in range(attempts):
            try:
                os.link(tmp, lock)  # appears complete, owner inside, already locked
                return Claim(run_dir, mine)
            except FileExistsError:
                pass
            try:
                theirs = os.open(lock, os.O_RDONLY)
            except FileNotFoundError:
                continue  # released meanwhile: try to create it again
            try:
                try:
                    fcntl.flock(theirs, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    owner = _shown(os.pread(theirs, 200, 0).decode(errors="replace"))
                    raise RunDirBusy(f"run directory {run_dir} is in use by a live run ({owner}); "
                                     "wait for it, stop it, or pass another --run-dir") from None
                try:
                    same = os.stat(lock).st_ino == os.fstat(theirs).st_ino
                except FileNotFoundError:
                    same = False
                if same:  # its owner is gone and we hold its lock: replace it with ours
                    os.rename(tmp, lock)
                    return Claim(run_dir, mine)
            finally:
                os.close(theirs)
        raise RunDirBusy(f"could not claim run directory {run_dir}; other runs keep starting there")
    except BaseException:
        os.close(mine)
        raise
    finally:
        tmp.unlink(missing_ok=True)  # linked or renamed: the lock is the same file under its own name


def publish(run_dir: Path, staging: Path) -> None:
    """Replace ``run_dir``'s previous results with what ``staging`` holds: the old event files go, every
    file and folder of ``staging`` takes its name's place, metrics.json last (a reader never sees half a
    file, nor new metrics beside old events); then ``staging`` is removed."""
    for old in run_dir.glob(EVENTS):
        old.unlink()
    for new in sorted(staging.iterdir()):
        if new.name == METRICS:
            continue
        target = run_dir / new.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(new, target)
    if (staging / METRICS).exists():
        os.replace(staging / METRICS, run_dir / METRICS)
    else:
        (run_dir / METRICS).unlink(missing_ok=True)  # the old ones would describe another run
    shutil.rmtree(staging, ignore_errors=True)
