"""What the take-home training scripts share that is not about training: flags checked and bad input refused in
one line, files written atomically, checkpoints read safely, the device picked, steady-state steps timed, and
torch's @record with an atomic error file.

A learner copies it with the script, beside course/data.py, course/models.py and an empty course/__init__.py
(the way pytorch/vision's reference scripts keep a utils.py beside train.py). It imports torch and the
standard library only, nothing else of the course. torch is imported inside the functions that use it, so
that the course's own error module, which shares CourseError and @record with this one, loads without it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import pickletools
import statistics
import sys
import time
import warnings
from pathlib import Path


class CourseError(Exception):
    """A problem with the learner's input or environment; the message says what and where."""


def fail(message) -> None:
    """Bad input found before training: one "error: ..." line and exit status 2, as argparse does."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def number(kind, low, strict=True, high=None):
    """An argparse type: a finite ``kind`` (int or float) > ``low`` (>= ``low`` if not ``strict``) and <= ``high``
    (if given), else one error line. nan and inf are refused: a run cannot use them (--lr inf trains to nan)."""
    def parse(text):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} must be <= {high}")
        return value
    return parse


SEED_MAX = 2**63 - 1  # torch.manual_seed takes [-2**63, 2**64 - 1]; samplers add the epoch to the seed


def seed(text):
    """An argparse type for --seed: an integer torch.manual_seed takes, from 0 to SEED_MAX."""
    return number(int, 0, strict=False, high=SEED_MAX)(text)


def memory_bytes() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def too_big(needed: float, what: str = "this run") -> str | None:
    """Why ``needed`` bytes cannot fit this machine's memory, in words; None if they may."""
    have = memory_bytes()
    if have is None or needed <= have:
        return None
    return f"{what} needs about {needed / 1e9:,.1f} GB, this machine has {have / 1e9:,.1f} GB"


def one_process_only(name: str, why: str = "is not distributed (train_ddp.py is)") -> None:
    """Stop a one-process script that torchrun started several times (--nproc-per-node=2): each copy would train
    its own model into the same files. Rank 0 says so in one line; every copy exits with status 2."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {name}.py {why}: run it as one process (python {name}.py, or torchrun "
                  "--nproc-per-node=1)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def check_writable(path, what="the checkpoint") -> Path:
    """Refuse a file path that cannot be written now (CourseError naming the cause), not after an epoch of
    training: its folder is created if needed and must accept a new file (a probe file is created and removed);
    the path must not be a folder."""
    path = Path(path)
    if path.is_dir():
        raise CourseError(f"cannot write {what} {path}: it is a folder; name a file in it".replace("  ", " "))
    check_folder(path.parent, what, path)
    return path


def check_folder(folder, what="the run directory", named=None, create=True) -> Path:
    """Refuse a folder the run cannot write into (CourseError naming the cause), before any process group: it
    must be a folder or creatable (created unless not ``create``), and a probe file must be creatable and
    removable in it (or, not created, in the nearest folder above it that exists)."""
    folder, named = Path(folder), Path(named or folder)
    what = f"cannot write {what} {named}".replace("  ", " ")
    blocker = next((p for p in [*reversed(folder.parents), folder] if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # mkdir would only say "File exists"
        raise CourseError(f"{what}: {blocker} is a file, not a folder")
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        probe = next(p for p in [folder, *folder.parents] if p.is_dir()) / f".probe.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise CourseError(f"{what}: {error.strerror or error}") from None
    return folder


def save_atomically(obj, path, save=None) -> None:
    """save(obj, file) (torch.save by default) into a temporary file, then rename it onto ``path``: a crash
    mid-write leaves the old file whole. One temporary name per file, so the next save reuses whatever a killed
    writer left."""
    import torch

    save, path = save or torch.save, Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:  # a plain open: the file gets the user's umask, like torch.save(obj, path)
        save(obj, f)
    os.replace(tmp, path)  # atomic on POSIX and Windows


def save_json(obj, path) -> None:
    """``obj`` as indented JSON, atomically (a reader never sees half a metrics.json)."""
    save_atomically(obj, path, lambda o, f: f.write(json.dumps(o, indent=2).encode()))


def sha256(file) -> str:
    """The file's sha256, as hex."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder, name="sha256.json") -> Path:
    """After a DCP save, on one process, once every rank's pieces are on disk (after a barrier): the sha256 of
    .metadata and of each *.distcp file, written atomically into ``name``. DCP keeps no checksum of its own;
    course.dcp_check refuses a folder whose files no longer match."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and (p.name == ".metadata" or p.suffix == ".distcp"))
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"sha256": {p.name: sha256(p) for p in files}}, indent=1))
    os.replace(tmp, folder / name)
    return folder / name


def pickled_calls(path, limit: int = 1 << 20) -> list[str]:
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


def read_checkpoint(path, device="cpu"):
    """torch.load for files a learner names: weights_only=True (no code runs), map_location onto *this*
    process's device. A file that is corrupt, truncated or asks to run code raises CourseError naming it (one
    line; torch's warnings about the file are not shown). Whether it fits the model is the caller's check."""
    import torch

    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4 in the checkpoint", once per rank
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError) as error:
        # (IndexError: torch's weights_only unpickler reading past the end of a truncated legacy file)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        code = [line.split("GLOBAL ", 1)[1].split(" ")[0] for line in lines if "GLOBAL " in line]
        code = code or pickled_calls(path)  # a legacy pickle: torch only says "Unsupported operand"
        if code:
            raise CourseError(f"checkpoint {path} is not a plain tensor checkpoint: loading it would run code "
                              f"({code[0]}), so it was refused; load it with weights_only=False only if you "
                              "trust whoever made it") from None
        detail = next((line for line in lines if "Unsupported" in line), lines[0]).split(". ")[0]
        raise CourseError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {detail})") from None


def load_weights(path, model, device="cpu", skip=(), state=None) -> dict:
    """Load the weights in ``path`` (or its already read contents ``state``) into ``model``; return the contents.
    The file may be a plain state_dict (e.g. torchvision's ImageNet weights) or a checkpoint with a "model"
    entry. Tensors whose names start with a prefix in ``skip`` (e.g. "fc." for a replaced head) are neither
    loaded nor required; anything else that does not fit raises CourseError naming the first tensor."""
    import torch

    if state is None:
        state = read_checkpoint(path, device)
    weights = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CourseError(f"{path} holds no state_dict (a dict of tensors, or a checkpoint with a 'model' entry)")
    weights = {k.removeprefix("module."): v for k, v in weights.items() if not k.startswith(skip)}
    mine = {k: v for k, v in model.state_dict().items() if not k.startswith(skip)}
    differ = sorted(set(mine) ^ set(weights)) + [k for k in mine if k in weights and mine[k].shape != weights[k].shape]
    if differ:
        k = differ[0]
        shape = lambda d: tuple(d[k].shape) if k in d else "absent"
        name = getattr(model, "course_name", type(model).__name__)
        raise CourseError(f"{path} does not fit a {name} ({len(differ)} tensors differ; first {k}: "
                          f"{shape(weights)} in the file, {shape(mine)} in the model): another architecture?")
    model.load_state_dict(weights, strict=not skip)
    return state if isinstance(state, dict) and "model" in state else {"model": state}


def pick_device():
    """One plain process: the torch.device of this machine's accelerator if it has one (CUDA, MPS, XPU, ...), else the CPU."""
    import torch

    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")


def pick_device_and_backend(local_rank: int, local_world_size: int):
    """One rank of a process group: (device, backend), <accelerator>:local_rank with PyTorch's backend for it (nccl for CUDA, xccl
    for XPU) if this machine has one for each of its local_world_size processes and that backend carries its
    tensors; else the CPU and gloo (so on a Mac, whose MPS device gloo cannot carry, ranks use the CPU)."""
    import torch
    import torch.distributed as dist

    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator and torch.accelerator.device_count() >= local_world_size:
        backend = dist.Backend.default_device_backend_map.get(accelerator.type)
        if accelerator.type in dist.Backend.backend_capability.get(backend, ()):
            return torch.device(accelerator.type, local_rank), backend
    return torch.device("cpu"), "gloo"


class StepTimer:
    """Samples per second in the steady state: the first ``warmup_steps`` steps (allocation, caches, DDP's first
    bucket rebuild) are not timed, nor is anything between start() and the first tick() (e.g. evaluation).
    ``sync``: a function that waits for the device (torch.accelerator.synchronize), so that a GPU's queued work
    is counted in the step that queued it; None on a CPU."""

    def __init__(self, warmup_steps: int = 3, sync=None):
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        self.warmup_steps, self.sync = warmup_steps, sync
        self.steps, self.durations, self.samples, self._last = 0, [], 0, None

    def start(self) -> None:
        """Start (or restart, after evaluation) the clock: call just before the first step of an epoch."""
        if self.sync:
            self.sync()
        self._last = time.perf_counter()

    def tick(self, samples: int) -> None:
        """One step is done; it had ``samples`` samples (on this process)."""
        if self.sync:
            self.sync()
        now = time.perf_counter()
        if self._last is None:
            raise RuntimeError("StepTimer.start() was not called before the first tick()")
        if self.steps >= self.warmup_steps:
            self.durations.append(now - self._last)
            self.samples += samples
        self.steps += 1
        self._last = now

    @property
    def samples_per_s(self) -> float | None:
        """Steady-state samples/s of this process; None when no step after the warm-up was timed."""
        total = sum(self.durations)
        return self.samples / total if total > 0 else None

    def summary(self, world_size: int = 1) -> dict:
        """What a run writes into metrics.json. samples_per_s is summed over ``world_size`` processes (each timed
        its own steps, of the same length)."""
        rate = self.samples_per_s
        return {"samples_per_s": rate * world_size if rate is not None else None,
                "timed_steps": len(self.durations), "warmup_steps": min(self.warmup_steps, self.steps),
                "step_time_median_s": statistics.median(self.durations) if self.durations else None}

    def line(self, world_size: int = 1) -> str:
        """The speed, for a script's last line."""
        rate = self.samples_per_s
        return (f"{rate * world_size:.0f} samples/s ({len(self.durations)} timed steps)" if rate
                else "no step timed after the warm-up")


def record(main):
    """torch's ``@record`` (under torchrun, a crash shows this process's traceback instead of
    "error_file: <N/A>"), with its error file written whole or not at all: torch writes it in place, and a rank
    stopped mid-write (torchrun ending the job after another rank failed) left an empty file on which torchrun
    itself died with a JSONDecodeError."""
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


def _copied_without_init() -> Path | None:
    """The running script's own course/ folder, if it has no __init__.py (and so is not this module's folder): a
    folder without it is a namespace package, which loses to a course package installed anywhere on sys.path,
    so Python imported that course's modules instead of the learner's data.py and models.py."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    theirs = script.parent / "course" if script else None
    if theirs and theirs.is_dir() and not (theirs / "__init__.py").exists() and theirs != Path(__file__).parent.resolve():
        return theirs
    return None


if (_theirs := _copied_without_init()) is not None:
    fail(f"{_theirs} has no __init__.py, so Python imported the course installed at {Path(__file__).parent} "
         f"instead of your files; create an empty {_theirs / '__init__.py'}")
