"""Is a distributed checkpoint (DCP) folder whole? One line saying which checkpoint and what is wrong with it.

    from course.dcp_check import problem, load_failure
    if (why := problem("runs/ckpt")) is not None:   # before any process group: cheap, reads no tensor
        parser.error(f"argument --load: {why}")
    try:
        dcp.load(state, checkpoint_id="runs/ckpt")
    except BaseException as error:                  # CheckpointException is a BaseException
        message = load_failure("runs/ckpt", error)  # every rank gets it; rank 0 prints this one line

A DCP checkpoint is a folder: ``.metadata`` (a pickle of where every piece of every tensor sits: which
file, at which byte, how many bytes) and one ``*.distcp`` file per saving rank, each a row of pieces that
``torch.save`` wrote one after another. ``problem`` checks the folder, unpickles ``.metadata`` with an
unpickler that builds only DCP's own metadata classes (a ``.metadata`` that asks for anything else would run
code: refused, never loaded), and checks that every piece's file exists, is long enough, and starts where
the metadata says with the bytes every ``torch.save`` starts with. A piece damaged further inside still
fails in ``dcp.load``; ``load_failure`` turns that into one line too, without torch's advice to retry with
``weights_only=False`` (which would unpickle whatever the file holds).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

ZIP_START = b"PK\x03\x04"  # torch.save's (zip) format: every stored piece starts with it
_DCP = "torch.distributed.checkpoint."
_PLAIN = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
          ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
          ("collections", "OrderedDict")}


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes, sizes and paths; refuses every other global."""

    def find_class(self, module, name):
        if "." not in name:
            if module.startswith(_DCP) or (module, name) in _PLAIN:
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
