"""Checkpoints that survive a crash mid-write and load onto whatever device this process has.

    check_writable(path)           # at start-up: CourseError naming the real cause (e.g. a parent is a file)
    save_checkpoint(state, path)   # atomic; mode from the umask, like torch.save; stale temporaries removed
    read_checkpoint(path, device)  # a file a learner names: corrupt, truncated or code-running -> one line

Relative paths are taken from the course's root folder. check_writable and read_checkpoint are the take-home
scripts' own (course.train_utils), applied to that path.
"""

import os
import re
import tempfile
from pathlib import Path

import torch

from course import in_repo, train_utils
from course.train_utils import pickled_calls  # noqa: F401 (its home is course.train_utils)


def check_writable(path: str | Path) -> Path:
    """Fail at start-up, naming the path, rather than after an epoch of training: the folder of ``path``
    is created if needed and must accept a new file; ``path`` must not be a folder."""
    return train_utils.check_writable(in_repo(path))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(path: Path) -> None:
    """Temporaries of this checkpoint's name whose writer is gone (killed mid-write); a live writer's stay."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.[^.]+\.tmp$")
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        match = pattern.match(tmp.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            tmp.unlink(missing_ok=True)


def save_checkpoint(state: dict, path: str | Path) -> Path:
    """Write to a temporary file of this writer's own, then rename: a crash leaves the old checkpoint,
    never half a new one, and two runs saving to one path never share a temporary file. The file gets the
    mode a plain torch.save would (0666 less the umask); a successful save removes the temporaries that
    killed writers left under this name."""
    path = in_repo(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 whatever the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)  # atomic on POSIX and Windows
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _remove_stale_temporaries(path)
    return path


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> dict:
    """weights_only=True refuses pickled code; map_location puts tensors on *this* process's device
    (without it, tensors saved from cuda:0 all land on cuda:0 in every rank)."""
    return torch.load(in_repo(path), map_location=device, weights_only=True)


def read_checkpoint(path: str | Path, device: torch.device | str = "cpu"):
    """load_checkpoint, for files a learner names: one that is corrupt, truncated or asks to run code raises
    CourseError naming it (one line, not a traceback; torch's warnings about the file are not shown).
    Whether it fits the model is the caller's check."""
    return train_utils.read_checkpoint(in_repo(path), device)
