"""Is a distributed checkpoint (DCP) folder whole, and does it hold only data? One line saying which checkpoint
and what is wrong with it; the load planner that unpickles no code; and the sha256 manifest.

    from course.dcp_check import WeightsOnlyPlanner, problem, load_failure, unverified, write_manifest
    if (why := problem("runs/ckpt")) is not None:   # before any process group: runs no code
        parser.error(f"argument --load: {why}")
    if (note := unverified("runs/ckpt")) is not None:
        print(note)                                 # a folder written elsewhere: loaded, not verified
    try:
        dcp.load(state, checkpoint_id="runs/ckpt", planner=WeightsOnlyPlanner())  # every DCP load of the course
    except BaseException as error:                  # CheckpointException is a BaseException
        message = load_failure("runs/ckpt", error)  # every rank gets it; rank 0 prints this one line

    dcp.save(state, checkpoint_id="runs/ckpt"); dist.barrier()   # numbers as tensors (torch.tensor(step))
    if rank == 0:
        write_manifest("runs/ckpt")                 # after every piece: sha256 of each file, written atomically

A DCP checkpoint is a folder: ``.metadata`` (a pickle of where every piece of every tensor sits: which
file, at which byte, how many bytes) and one ``*.distcp`` file per saving rank, each a row of pieces that
``torch.save`` wrote one after another: the tensors, and every other item of the state dict (an int, the
optimizer's param_groups, or any object) as a pickle. DCP loads the tensors with torch's weights-only
unpickler, but the other items with ``weights_only=False``: such an item can run any code when loaded.
So nothing here is unpickled without a restricted unpickler: ``problem`` reads ``.metadata`` with one that
builds only DCP's own metadata classes, then every non-tensor item with torch's weights-only unpickler
(plain data: numbers, strings, lists, dicts, tensors), and refuses a folder that asks for anything else;
``WeightsOnlyPlanner`` does the same inside ``dcp.load`` (a folder changed after the check still runs
nothing), and ``dcp_to_torch_save`` is torch's, with that planner. ``problem`` also checks that every piece's
file exists, is long enough, and starts where the metadata says with the bytes every ``torch.save`` starts
with. ``load_failure`` turns what ``dcp.load`` still raises (a checkpoint of another model) into one line
too, without torch's advice to retry with ``weights_only=False``.

DCP stores no checksum, so a few bytes damaged inside a piece (an optimizer state, say) would load silently:
the course writes ``sha256.json`` beside the pieces and ``problem`` checks every file against it first.
It catches damage, not tampering: whoever can replace a piece can rewrite the manifest too. The restricted
unpicklers keep code from running as far as torch's weights-only unpickler does, and a checkpoint's numbers
can still be anything: load only checkpoints you trust.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

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


class ItemRefused(pickle.UnpicklingError):
    """A non-tensor item of a checkpoint that torch's weights-only unpickler refuses: it would run code (or it
    is damaged). Its text is the line's end: "its item 'epoch' asks to run code (io.open) ..."."""


def load_item(raw: bytes, name: str, map_location=None):
    """One non-tensor item of a DCP checkpoint (what ``torch.save`` wrote of it), unpickled by torch's
    weights-only unpickler: plain data comes back; anything that would run code raises ItemRefused."""
    try:
        return torch.load(io.BytesIO(raw), map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - a refused global, or a damaged pickle raising almost anything
        try:  # which globals it asks for, read without unpickling (torch disassembles the pickle)
            wanted = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw))
        except Exception:  # noqa: BLE001
            wanted = []
        if wanted:
            raise ItemRefused(f"its item '{name}' asks to run code ({', '.join(wanted)}) when loaded, so it was "
                              "refused (a checkpoint's items hold only data)") from None
        raise ItemRefused(f"its item '{name}' is damaged or holds more than plain data ({type(error).__name__}), "
                          "so it was refused") from None


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, except that every non-tensor item is unpickled by ``load_item`` (torch's
    weights-only unpickler) instead of ``torch.load(..., weights_only=False)``: ItemRefused, nothing run."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        item = load_item(value.read(), name)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes puts it
            set_element(self.original_state_dict, self.mappings[name], item)
        else:
            self.state_dict[name] = item


class _WholeWeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
    """The planner of torch's dcp_to_torch_save (the state dict built from the metadata), weights-only."""

    load_bytes = WeightsOnlyPlanner.load_bytes


def dcp_to_torch_save(path: str | Path, torch_save_path: str | Path) -> None:
    """torch's ``format_utils.dcp_to_torch_save`` (every piece joined into one ordinary file, in this process,
    without a process group), reading the non-tensor items as ``WeightsOnlyPlanner`` does."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(path)), planner=_WholeWeightsOnlyPlanner(),
                     no_dist=True)
    torch.save(state, torch_save_path)


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
    kinds = getattr(metadata, "state_dict_metadata", None)  # each item's kind: a tensor, or bytes (a pickle)
    if not isinstance(storage, dict) or not storage or not isinstance(kinds, dict):
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
        descriptors = getattr(info, "transform_descriptors", None)
        if not descriptors:  # stored as torch.save wrote it (no compression)
            with open(file, "rb") as f:
                f.seek(info.offset)
                if f.read(len(ZIP_START)) != ZIP_START:
                    return (f"checkpoint {path}: the shard file {what} is corrupt: at byte {info.offset:,}, where "
                            ".metadata places a piece, it holds no saved tensor")
        if isinstance(kinds.get(index.fqn), BytesStorageMetadata):  # not a tensor: a pickle
            with open(file, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            try:
                if descriptors:  # as DCP's reader undoes them
                    raw = dcp.FileSystemReader(str(path)).transforms.transform_load_stream(
                        None, descriptors, io.BytesIO(raw)).read()
                load_item(raw, index.fqn, map_location="cpu")
            except ItemRefused as refused:
                return f"checkpoint {path}: {refused}"
            except Exception as error:  # noqa: BLE001 - a transform that cannot undo damaged bytes
                return f"checkpoint {path}: its item '{index.fqn}' is corrupt ({type(error).__name__})"
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
    if isinstance(error, ItemRefused):  # WeightsOnlyPlanner: an item that would run code, nothing run
        text = str(error)
    elif isinstance(error, pickle.UnpicklingError) or any("weights_only" in line for line in lines):
        text = "a shard file holds bytes that are not a saved tensor: the checkpoint is corrupt"
    else:
        text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return f"checkpoint {path} could not be loaded{where}: {text}"
