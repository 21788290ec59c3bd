"""Is a distributed checkpoint (DCP) folder whole and what the course wrote? One line saying which checkpoint
and what is wrong with it; and the sha256 manifest that lets it say so.

    from course.dcp_check import problem, load_failure, unverified, write_manifest
    if (why := problem("runs/ckpt")) is not None:   # before any process group: reads no tensor, runs no code
        parser.error(f"argument --load: {why}")
    if (note := unverified("runs/ckpt")) is not None:
        print(note)                                 # a folder written elsewhere: loaded, not verified
    try:
        dcp.load(state, checkpoint_id="runs/ckpt")
    except BaseException as error:                  # CheckpointException is a BaseException
        message = load_failure("runs/ckpt", error)  # every rank gets it; rank 0 prints this one line

    dcp.save(state, checkpoint_id="runs/ckpt"); dist.barrier()
    if rank == 0:
        write_manifest("runs/ckpt")                 # after every piece: sha256 of each file, written atomically

A DCP checkpoint is a folder: ``.metadata`` (a pickle of where every piece of every tensor sits: which
file, at which byte, how many bytes) and one ``*.distcp`` file per saving rank, each a row of pieces that
``torch.save`` wrote one after another. DCP stores no checksum, so a few bytes damaged inside a piece (an
optimizer state, say) load silently; the course writes ``sha256.json`` beside them, and ``problem`` checks
every file against it first. Then it unpickles ``.metadata`` with an unpickler that builds only DCP's own
metadata classes (a ``.metadata`` that asks for anything else would run code: refused, never loaded), and
checks that every piece's file exists, is long enough, and starts where the metadata says with the bytes
every ``torch.save`` starts with. ``load_failure`` turns what ``dcp.load`` still raises (a checkpoint of
another model) into one line too, without torch's advice to retry with ``weights_only=False``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from course.train_utils import sha256, write_manifest  # noqa: F401 (the take-home scripts' own)

MANIFEST = "sha256.json"  # {"sha256": {file name: hex digest}} of .metadata and every piece file (write_manifest)
ZIP_START = b"PK\x03\x04"  # torch.save's (zip) format: every stored piece starts with it
_DCP = "torch.distributed.checkpoint.metadata"  # Metadata and the classes it holds (dataclasses, an enum)
_STORAGE = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")  # where each piece sits in its file
_PLAIN = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
          ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
          ("collections", "OrderedDict")}


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes, sizes and paths; refuses every other global."""

    def find_class(self, module, name):
        if "." not in name:
            if module == _DCP or (module, name) in _PLAIN or (module, name) == _STORAGE:
                found = super().find_class(module, name)
                if (module, name) in _PLAIN or isinstance(found, type):
                    return found
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def read_metadata(path: str | Path):
    """The checkpoint's Metadata, unpickled without running code (``_Refused`` for a file that would)."""
    with open(Path(path) / ".metadata", "rb") as f:
        return _MetadataUnpickler(f).load()


def _stored_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and (p.name == ".metadata" or p.suffix == ".distcp"))


def _manifest_problem(path: Path) -> str | None:
    """What does not match the checkpoint's sha256.json; None if all does (or there is none)."""
    try:
        digests = json.loads((path / MANIFEST).read_text())["sha256"]
        assert isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"checkpoint {path}: its {MANIFEST} is damaged, so its files cannot be verified"
    for name in sorted(set(digests) | {p.name for p in _stored_files(path)}):
        if name not in digests:
            return f"checkpoint {path}: {name} is not in its {MANIFEST} (a file from another save?)"
        file = path / Path(name).name
        if not file.is_file():
            return f"checkpoint {path}: the file {name} listed in its {MANIFEST} is missing"
        if sha256(file) != digests[name]:
            return (f"checkpoint {path}: {name} does not match its sha256 in {MANIFEST}: the file was damaged or "
                    "changed after it was written")
    return None


def unverified(path: str | Path) -> str | None:
    """The line to print when loading a checkpoint without a manifest (written elsewhere); None if it has one."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return None
    return f"note: checkpoint {path} has no {MANIFEST} (not written by the course): loaded without verifying its bytes"


def problem(path: str | Path) -> str | None:
    """What is wrong with the DCP checkpoint at ``path``, in one line; None if it looks whole."""
    path = Path(path)
    if not path.exists():
        return f"checkpoint {path} does not exist"
    if not path.is_dir():
        return f"checkpoint {path} is a file; a DCP checkpoint is a folder (.metadata and *.distcp files)"
    if not any(path.iterdir()):
        return f"checkpoint {path} is an empty folder (no .metadata, no *.distcp files)"
    if not (path / ".metadata").is_file():
        return (f"checkpoint {path} has no .metadata file: not a whole DCP checkpoint (a save that did not "
                "finish, or another kind of folder)")
    if (why := _manifest_problem(path)) is not None:  # before .metadata is unpickled at all
        return why
    try:
        metadata = read_metadata(path)
    except _Refused as refused:
        return (f"checkpoint {path}: its .metadata asks to run code ({refused}) when loaded, so it was refused "
                "(a DCP .metadata holds only data)")
    except Exception as error:  # noqa: BLE001 - a damaged pickle raises almost anything
        return f"checkpoint {path}: its .metadata is corrupt or truncated ({type(error).__name__})"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not storage:
        return f"checkpoint {path}: its .metadata lists no stored pieces"
    for index, info in storage.items():
        file = path / info.relative_path
        what = f"{info.relative_path} (which holds {index.fqn})"
        if not file.is_file():
            return f"checkpoint {path}: the shard file {what} is missing"
        end = info.offset + info.length
        if file.stat().st_size < end:
            return (f"checkpoint {path}: the shard file {what} is truncated: {file.stat().st_size:,} bytes, "
                    f".metadata places a piece up to byte {end:,}")
        if not getattr(info, "transform_descriptors", None):  # stored as torch.save wrote it (no compression)
            with open(file, "rb") as f:
                f.seek(info.offset)
                if f.read(len(ZIP_START)) != ZIP_START:
                    return (f"checkpoint {path}: the shard file {what} is corrupt: at byte {info.offset:,}, where "
                            ".metadata places a piece, it holds no saved tensor")
    return None


def load_failure(path: str | Path, error: BaseException) -> str:
    """One line for what ``dcp.load`` raised: the first failing rank's own error (a size that does not match
    the model, a damaged piece), never torch's suggestion to unpickle the file with weights_only=False."""
    failures = getattr(error, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if failures:
        rank, (error, _) = min(failures.items())
        where = f" (rank {rank})"
    else:
        where = ""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, pickle.UnpicklingError) or any("weights_only" in line for line in lines):
        text = "a shard file holds bytes that are not a saved tensor: the checkpoint is corrupt"
    else:
        text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return f"checkpoint {path} could not be loaded{where}: {text}"
