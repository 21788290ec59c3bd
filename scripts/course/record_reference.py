"""Record the capstone's reference GPU runs, for learners without GPUs (notebook 07, section 8).

    python -m course.record_reference            # on a machine with GPUs; writes runs/reference/<gpu>_np<N>/

Trains scripts/train_flowers.py with the full-mode settings on 1 GPU and on every GPU of the machine and
keeps only what a comparison needs and what is small enough to commit: each run's TensorBoard event files
and metrics.json (no checkpoints). A learner then opens runs/reference next to their own CPU runs in one
TensorBoard. On a machine without GPUs it refuses with one line and exit status 2: CPU runs are no reference.
"""

import argparse
import re
import shutil
import sys

from course import ROOT, RUNS, WEIGHTS, in_repo
from course.hardware import accelerator, accelerator_name

REFERENCE = RUNS / "reference"
SETTINGS = ["--image-size", "64", "--epochs", "8", "--global-batch", "64", "--batch-size", "32", "--workers", "4",
            "--show-images", "16"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REFERENCE), help="where the reference runs go (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    kind, count = accelerator()
    if kind != "cuda" or count < 1:
        print(f"record_reference: no GPU here ({accelerator_name(kind) + 's: ' + str(count) if kind else 'CPU only'}); "
              "nothing recorded: run it on a machine with GPUs", file=sys.stderr)
        return 2
    import torch

    from course.launcher import launch

    gpu = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(0)).strip("_").lower()
    out = in_repo(args.out)
    for nproc in sorted({1, count}):
        name = f"{gpu}_np{nproc}"
        scratch = RUNS / "07_capstone_flowers" / "reference_scratch" / name
        launch("train_flowers.py", nproc, [*SETTINGS, "--checkpoint-dir", str(WEIGHTS / "reference" / name)],
               run_dir=scratch, timeout=args.timeout, quiet=False)
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for path in [*scratch.glob("events.out.tfevents.*"), scratch / "metrics.json"]:
            shutil.copy2(path, target / path.name)
        print(f"recorded {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
