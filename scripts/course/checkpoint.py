"""Checkpoints that survive a crash mid-write and load onto whatever device this process has."""

import os
import pickle
import tempfile
from pathlib import Path

import torch

from course import in_repo
from course.errors import CourseError


def check_writable(path: str | Path) -> Path:
    """Fail at start-up, naming the path, rather than after an epoch of training: the folder of ``path``
    is created if needed and must accept a new file."""
    path = in_repo(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as error:
        raise CourseError(f"cannot write the checkpoint {path}: {error.strerror or error}") from None
    if path.is_dir():
        raise CourseError(f"cannot write the checkpoint {path}: it is a folder")
    return path


def save_checkpoint(state: dict, path: str | Path) -> Path:
    """Write to a temporary file of this writer's own, then rename: a crash leaves the old checkpoint,
    never half a new one, and two runs saving to one path never share a temporary file."""
    path = in_repo(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)  # atomic on POSIX and Windows
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> dict:
    """weights_only=True refuses pickled code; map_location puts tensors on *this* process's device
    (without it, tensors saved from cuda:0 all land on cuda:0 in every rank)."""
    return torch.load(in_repo(path), map_location=device, weights_only=True)


def read_checkpoint(path: str | Path, device: torch.device | str = "cpu"):
    """load_checkpoint, for files a learner names: one that is corrupt, truncated or asks to run code raises
    CourseError naming it (one line, not a traceback). Whether it fits the model is the caller's check."""
    try:
        return load_checkpoint(path, device)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, KeyError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        code = [line for line in lines if "GLOBAL" in line]  # the function the file wants called
        if code:
            raise CourseError(f"checkpoint {path} asks to run code or build objects, which weights_only=True "
                              f"refuses ({code[0].split('. ')[0]}); load it without weights_only only if you trust it"
                              ) from None
        detail = next((line for line in lines if "Unsupported" in line), lines[0]).split(". ")[0]
        raise CourseError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {detail})") from None
