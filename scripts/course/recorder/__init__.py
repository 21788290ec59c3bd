"""What runs inside the ranks for the exercise checker and the DDP doctor: one package, started by path.

    torchrun --nproc-per-node=2 scripts/course/recorder/recorder.py SCRIPT [ARGS...]

``recorder.py`` is the entry: it runs SCRIPT as ``python SCRIPT`` would and records what each rank did; its
siblings (``recorder_collectives``, ``recorder_training``) are imported by their plain names from this folder,
so that the recorder works beside a learner's own ``course`` package. Nothing here imports ``course``.
"""

from pathlib import Path

ENTRY = Path(__file__).with_name("recorder.py")  # what torchrun starts
