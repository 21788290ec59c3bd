"""Checkpoints that survive a crash mid-write and load onto whatever device this process has."""

import os
from pathlib import Path

import torch


def save_checkpoint(state: dict, path: str | Path) -> Path:
    """Write to a temporary file, then rename: a crash leaves the old checkpoint, never half a new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic on POSIX and Windows
    return path


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> dict:
    """weights_only=True refuses pickled code; map_location puts tensors on *this* process's device
    (without it, tensors saved from cuda:0 all land on cuda:0 in every rank)."""
    return torch.load(path, map_location=device, weights_only=True)
