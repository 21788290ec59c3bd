"""Shared helpers for the course: one module per concern.

Two packages under scripts/, the course on top of the take-home tool, never the reverse:
- ``ddp_doctor``  the DDP doctor, installed alone (``make doctor-wheel``; torch its only requirement): the doctor
  (``check``, ``ddp-doctor``), the recorder that runs inside the ranks (``ddp_doctor.recorder``, shared with the
  exercise checker), the runner that starts, bounds, watches and stops a torchrun job and names the failing rank
  (``ddp_doctor.runner``, shared with the notebook launcher), the device/backend rule (``ddp_doctor.hardware``) and
  the run-directory claim (``ddp_doctor.rundir``). It imports nothing of ``course`` (a test checks it); its map is
  its own ``__init__``.
- ``course``      this package, the course's helpers below; it imports those shared pieces from ``ddp_doctor``.

The core path's scripts (train_single.py, train_ddp.py) are plain PyTorch and import none of these.
Used by the other training scripts (import only what a training process needs):
- ``course.hardware``    which device and backend a process uses, by ``ddp_doctor.hardware``'s one rule
- ``course.data``        load the datasets (generated, or real ones via COURSE_*_DIR)
- ``course.models``      the MLP, a small CNN and ResNet-18
- ``course.train_utils`` what the take-home scripts share that is not about training (copied with them)
- ``course.runlog``      TensorBoard events + metrics.json, written by rank 0, never destroying a previous run
- ``course.checkpoint``  atomic save, safe load, writable check
- ``course.measure``     steady-state step timing (scripts) and interleaved comparisons (notebooks)
- ``course.args``        argparse validators; ``course.errors``  one clear error, printed once
- ``course.commhooks``   a DDP communication hook that counts all-reduces and bytes (notebook 05)
- ``course.sharding``    memory of sharded training, predicted and counted (notebook 08)
- ``course.notebook``    ``in_notebook()``: the one rule for "am I running in a Jupyter kernel?" (``ddp_doctor.report``'s)
- ``course.quiz``        "Check yourself" questions that start unanswered (keys in ``course/answer_key/``)
- ``course.exercise_tasks`` data, models and a step recorder for notebook 09's exercise scripts
- ``course.capstone``    the capstone's weight loading and image check (notebook 07)
- ``course.gpt``         the small GPT of notebooks 10-12; ``course.lm_data``  its generated arithmetic data
- ``course.gpt_stages``  the GPT cut into pipeline stages; ``course.pp_recorder``  what each stage did (notebook 11)
- ``course.comm_count``  collectives and bytes a piece of code runs, counted and predicted (notebooks 10, 12)
- ``course.moe``         the mixture-of-experts layer of notebook 12 and exercise 9
- ``course.rundir``      one live run per run directory (``ddp_doctor.rundir``'s claim), results replaced all at once,
  a resumed run's events kept
- ``course.dcp_check``   is a DCP checkpoint folder whole, and does it hold only data: one line saying what is wrong;
  the weights-only load planner every DCP load of the course uses (notebooks 08, 12)
Used by notebooks and tests:
- ``course.datagen``     generate the offline datasets (``make data``); ``course.flower_art`` draws one flower
- ``course.launcher``    torchrun from a notebook cell: live output, a course script by name, its run directory; the
  job run by ``ddp_doctor.runner`` (timeout, no orphans, the failing rank's error), whose names it offers too
- ``course.widget``      a launch panel; ``course.inline_tensorboard``  TensorBoard inline + matplotlib curves
- ``course.scriptdiff``  the diff between two scripts, checked for step markers
- ``course.rounds``      configurations of a script launched in alternating rounds (notebooks 01, 03)
- ``course.timeline``    per-rank timelines and overlap from torch.profiler traces (notebook 05)
- ``course.machine_report`` (00), ``course.ring_view`` (02), ``course.pitfall_jobs`` and ``course.spawn_capture``
  (04, 04b), ``course.scaling_model`` (05), ``course.flight_recorder`` (06), ``course.capstone_figures`` (07),
  ``course.shard_figures`` (08), ``course.bubble`` and ``course.pp_report`` (11): one notebook's plumbing or
  drawings each
- ``course.choose``      which parallelism fits: memory and communication per layout (notebook 12's table)
- ``course.published``   published GPU figures, labelled as such, for the cells that skip on a CPU
- ``course.exercises``   notebook 09's checker, a package: exercises checked against a one-process reference
- ``course.doctor_cases`` the doctor's test set (tests/fixtures/doctor), for its tests and ``course.bench_doctor``;
  ``course.doctor_wheel``  ``make doctor-wheel``; ``python -m course.doctor`` is ``ddp-doctor`` by its old name
- ``course.run_notebooks`` / ``course.lab`` / ``course.gpu_check``  ``make course`` / ``make lab`` / ``make gpu-check``
- ``course.times``       the course's times, one source (``notebooks/times.json``) for the README and every header
- ``course.soak``        ``make soak``: the quick course several times, in fresh clones, the last beside a busy core
- ``course.record_reference``  record the capstone's GPU runs under runs/reference (GPU machines only)
- ``course.bench_launcher`` / ``course.bench_noise`` / ``course.bench_checker`` / ``course.bench_doctor``
  benchmarks (``make bench``): the launcher's overhead; no faster/slower verdict for equal work and always one for
  a large difference; how often the exercise checker and the doctor are right, and what the recorder costs
- ``course.bench_report``  the benchmarks' figures into docs/benchmarks.json and the marked blocks of the README and docs/
- ``course.setup_torch``  ``make setup TORCH=cpu``: PyTorch's CPU-only build where its index answers
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


def import_script(name: str):
    """Import one of the course's scripts (``scripts/<name>.py``) as a module, e.g. to reuse its classes in a
    notebook. scripts/ goes on sys.path explicitly, as when the script itself runs, so that processes started
    by ``multiprocessing`` (which copy the parent's sys.path) can import it by name too."""
    import importlib
    import sys

    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def flag(name: str) -> bool:
    """An on/off environment switch (the one reader of them): unset, empty, 0 or false mean off."""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


# One documented switch: COURSE_QUICK=1 shrinks every run so the whole course fits in minutes on a laptop CPU.
QUICK = flag("COURSE_QUICK")
