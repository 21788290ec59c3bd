"""Shared helpers for the course: one module per concern.

- ``course.data``      offline datasets (generate, load, split)
- ``course.models``    the MLP, a small CNN and ResNet-18
- ``course.hardware``  which device and backend this machine gives a process
- ``course.runlog``    TensorBoard events + metrics.json for every run
- ``course.checkpoint`` atomic save, safe load
- ``course.launcher``  torchrun from a notebook cell: live output, timeout, no orphans
- ``course.tensorboard`` inline TensorBoard and matplotlib curves from event files
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
RUNS = ROOT / "runs"
WEIGHTS = ROOT / "weights"



def in_repo(path: str | os.PathLike) -> Path:
    """``path`` itself if absolute, else relative to the course's root folder (not the working directory)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else ROOT / path


# One documented switch: COURSE_QUICK=1 shrinks every run so the whole course fits in minutes on a laptop CPU.
QUICK = os.environ.get("COURSE_QUICK", "0") not in ("", "0", "false", "False")
