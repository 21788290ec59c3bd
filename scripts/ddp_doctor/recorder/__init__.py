"""What runs inside the ranks for the exercise checker and the DDP doctor: one package, started by path.

    torchrun --nproc-per-node=2 scripts/ddp_doctor/recorder/recorder.py SCRIPT [ARGS...]

``recorder.py`` is the entry: it runs SCRIPT as ``python SCRIPT`` would and records what each rank did; its
siblings (``recorder_collectives``, ``recorder_training``, ``recorder_spawn``, ``recorder_standin`` and the others) are imported
by their plain names from this folder, so that the recorder works beside whatever packages a learner's script
imports. Nothing here imports the rest of ``ddp_doctor``: the ranks load only this folder (and torch).
"""

from pathlib import Path

ENTRY = Path(__file__).with_name("recorder.py")  # what torchrun starts
