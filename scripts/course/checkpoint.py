"""Checkpoints that survive a crash mid-write and load onto whatever device this process has.

    check_writable(path)           # at start-up: CourseError naming the real cause (e.g. a parent is a file)
    save_checkpoint(state, path)   # atomic; mode from the umask, like torch.save; stale temporaries removed
    read_checkpoint(path, device)  # a file a learner names: corrupt, truncated or code-running -> one line
"""

import os
import pickle
import pickletools
import re
import tempfile
import warnings
from pathlib import Path

import torch

from course import in_repo
from course.errors import CourseError


def _file_in_parents(path: Path) -> Path | None:
    """The first existing parent of ``path`` that is a file, not a folder (mkdir would say "File exists")."""
    return next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), None)


def check_writable(path: str | Path) -> Path:
    """Fail at start-up, naming the path, rather than after an epoch of training: the folder of ``path``
    is created if needed and must accept a new file."""
    path = in_repo(path)
    blocker = _file_in_parents(path)
    if blocker is not None:
        raise CourseError(f"cannot write the checkpoint {path}: {blocker} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as error:
        raise CourseError(f"cannot write the checkpoint {path}: {error.strerror or error}") from None
    if path.is_dir():
        raise CourseError(f"cannot write the checkpoint {path}: it is a folder")
    return path


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


def pickled_calls(path: str | Path, limit: int = 1 << 20) -> list[str]:
    """The functions or classes beyond torch's weights_only allowlist that a plain (legacy, non-zip) pickle file
    would call when loaded, read without loading it; [] for a zip checkpoint or a file that is no pickle."""
    try:
        data = Path(path).read_bytes()[:limit]
    except OSError:
        return []
    calls, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(arg)
            elif op.name == "GLOBAL":
                calls.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                calls.append(f"{strings[-2]}.{strings[-1]}")
    except (ValueError, EOFError, pickle.UnpicklingError, UnicodeDecodeError, IndexError):
        pass
    try:  # what torch's weights_only unpickler allows (tensors, OrderedDict, ...) builds data, runs no code
        from torch._weights_only_unpickler import _get_allowed_globals
        allowed = set(_get_allowed_globals())
    except (ImportError, AttributeError):  # a private name: if it moves, judge by module name
        allowed = set()
    return [c for c in calls if c not in allowed and not (not allowed and c.startswith(("torch.", "collections.")))]


def read_checkpoint(path: str | Path, device: torch.device | str = "cpu"):
    """load_checkpoint, for files a learner names: one that is corrupt, truncated or asks to run code raises
    CourseError naming it (one line, not a traceback; torch's warnings about the file are not shown).
    Whether it fits the model is the caller's check."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4 in the checkpoint", once per rank
            warnings.simplefilter("ignore", UserWarning)
            return load_checkpoint(path, device)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError) as error:
        # (IndexError: torch's weights_only unpickler reading past the end of a truncated legacy file)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        code = [line.split("GLOBAL ", 1)[1].split(" ")[0] for line in lines if "GLOBAL " in line]
        code = code or pickled_calls(in_repo(path))  # a legacy pickle: torch only says "Unsupported operand"
        if code:
            raise CourseError(f"checkpoint {path} is not a plain tensor checkpoint: loading it would run code "
                              f"({code[0]}), so it was refused; load it with weights_only=False only if you "
                              "trust whoever made it") from None
        detail = next((line for line in lines if "Unsupported" in line), lines[0]).split(". ")[0]
        raise CourseError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {detail})") from None
