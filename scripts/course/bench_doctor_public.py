"""Benchmark: the DDP doctor on scripts in the shapes of widely copied public DDP code.

    python -m course.bench_doctor_public [--timing-repeats 5]        (or: make bench)

The set is tests/fixtures/doctor_public/cases.json, each script as its authors would have it (CUDA and NCCL,
mp.spawn, --local_rank): the PyTorch DDP tutorial series, the pytorch.org DDP tutorial's two examples, nanoGPT's
train.py, pytorch/examples' ImageNet main.py and the source article's train_multi_GPU rewritten from the published
files, with their own mistakes and none invented (tutorial_series/, pytorch_org/, nanogpt/, imagenet/, article/);
scripts written in the shapes of the pytorch.org tutorial's mp.spawn example, nanoGPT's train.py, torchvision's
reference, pytorch/examples' ImageNet main.py and minGPT-ddp with hydra, a Trainer with torch.compile, each with a
realistic mistake and a fixed version. Apart from the course's own set (course.bench_doctor).

Accuracy: every case once; recall is the share of expected findings made, false alarms the findings no case
expects. Time: for each fixed script, the doctor (as a learner runs it) against a plain run of the script,
interleaved (course.measure.compare). The plain run is the script as its author runs it (``python script.py`` for
a script that starts its own processes, else ``torchrun --standalone --nproc-per-node=2``), whole, without the
recorder; a script written for CUDA on a machine with fewer GPUs than ranks cannot run plain, so there it runs on
the CPU stand-in alone (``ddp_doctor/recorder/recorder_standin.py``, installed at start-up in every process), the
nearest to a plain run such a script has. Both get the pause at exit every job of the course launcher gets (gloo's
exit race, ``ddp_doctor/runner/startup/``), as the doctor's runs do. Everything goes to runs/benchmarks/doctor_public/metrics.json.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course import ROOT
from course import doctor_cases as cases
from course.args import nonnegative_int, repo_path
from course.measure import compare
from course.runlog import RunLog
from ddp_doctor.recorder import ENTRY as RECORDER
from ddp_doctor.runner.run import STARTUP

CASES = ROOT / "tests" / "fixtures" / "doctor_public" / "cases.json"
GOAL_SECONDS = 120  # issue 41: each check within 2 minutes on a CPU machine

# Start-up code of the plain runs of a CUDA script on a CPU machine: the stand-in, nothing recorded.
STANDIN_SITE = """import os, sys
if os.environ.get("COURSE_BENCH_STANDIN"):
    sys.path.insert(0, os.environ["COURSE_BENCH_STANDIN"])
    import recorder_standin
    recorder_standin.install({}, lambda: "", os.environ.get("COURSE_BENCH_PRETEND") == "1",
                             int(os.environ.get("LOCAL_WORLD_SIZE") or 2))
    sys.path.remove(os.environ["COURSE_BENCH_STANDIN"])
"""


def plain_command(case: cases.Case, launch: str, log_dir: Path) -> list:
    if launch == "spawn":
        return [sys.executable, str(case.script), *case.args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--log-dir",
            str(log_dir), str(case.script), *case.args]


def plain_env(work: Path, how: dict) -> dict:
    """The environment of a plain run: the stand-in where ``how`` says so (a CUDA script on a CPU machine)."""
    # The same pause at exit against gloo's exit race as every job the course launches (the doctor's included):
    # without it a plain run aborted after its last line now and then, and the timing stopped there. Its
    # sitecustomize comes first and runs the next one on the path: the stand-in's.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    site = None
    if how["standin"]:
        site = work / "standin_site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(STANDIN_SITE)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (STARTUP, site, os.environ.get("PYTHONPATH")) if p)
    if how["standin"]:
        env.update(COURSE_BENCH_STANDIN=str(RECORDER.parent),
                   COURSE_BENCH_PRETEND="1" if how["pretend"] else "", COURSE_RECORD_GPUS="2")
    return env


def plain_once(case: cases.Case, work: Path, how: dict, timeout: float = 300) -> float:
    """One plain run of ``case`` in a folder of its own; its wall time in seconds."""
    cwd = Path(tempfile.mkdtemp(prefix="plain-", dir=work))
    env = plain_env(work, how)
    start = time.monotonic()
    done = subprocess.run(plain_command(case, how["launch"], cwd / "logs"), cwd=cwd, env=env, check=False,
                          capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - start
    shutil.rmtree(cwd, ignore_errors=True)
    if done.returncode != 0:
        from ddp_doctor.runner.torchrun_output import describe_failure

        why = describe_failure(done.stdout + done.stderr, done.returncode).replace("\n", " | ")
        raise RuntimeError(f"{case.name}: the plain run failed: {why[:400]}")
    return seconds


def doctor_once(case: cases.Case, work: Path) -> float:
    outcome = cases.run_case(case, Path(tempfile.mkdtemp(prefix="doctor-", dir=work)))
    if outcome.report.status == 2:
        raise RuntimeError(f"{case.name}: the doctor could not check it: {outcome.report.error}")
    return outcome.seconds


def timing(case: cases.Case, work: Path, repeats: int) -> dict:
    from course.hardware import accelerator
    from ddp_doctor.running import style

    work.mkdir(parents=True, exist_ok=True)
    acc, count = accelerator()
    how = style(case.script, count if acc and acc != "mps" else 0, 2)
    try:
        result = compare({"plain": lambda: plain_once(case, work, how), "doctor": lambda: doctor_once(case, work)},
                         repeats=repeats, unit="s", higher_is_better=False)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return {"error": str(error).splitlines()[0][:500]}
    ratio = result["doctor"].median / result["plain"].median
    return {**result.to_dict(), "ratio": round(ratio, 2), "plain_on_standin": how["standin"],
            "launch": how["launch"]}


def accuracy_of(chosen: list, work: Path) -> dict:
    """Every case once (two at a time): recall, false alarms, each case's exit status, error and seconds."""
    outcomes = cases.run_all(chosen, work)
    accuracy = cases.score(outcomes)
    accuracy["status"] = {name: o.report.status for name, o in outcomes.items()}
    accuracy["errors"] = {name: o.report.error.splitlines()[0] for name, o in outcomes.items() if o.report.error}
    accuracy["found_per_case"] = {name: o.found for name, o in outcomes.items()}
    accuracy["standin_sites"] = {name: int(o.report.command.split("stand-in at ")[1].split()[0])
                                 if "stand-in at " in o.report.command else 0 for name, o in outcomes.items()}
    seconds = list(accuracy["seconds"].values())
    print(f"public shapes: recall {accuracy['found']}/{accuracy['expected_findings']} = {accuracy['recall']:.2f}; "
          f"false alarms {accuracy['false_alarms']} in {accuracy['cases']} cases ({accuracy['clean_cases']} without "
          f"a mistake); doctor {statistics.median(seconds):.0f} s median, {max(seconds):.0f} s max per case")
    return accuracy


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timing-repeats", type=nonnegative_int, default=5,
                        help="interleaved rounds of doctor and plain run per fixed script (0: no timing)")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="run every chosen case once for recall and false alarms")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--run-dir", type=repo_path, default="runs/benchmarks/doctor_public")
    args = parser.parse_args(argv)
    chosen = cases.load(CASES)
    if args.cases:
        names = set(args.cases.split(","))
        chosen = [c for c in chosen if c.name in names]
    log = RunLog(args.run_dir, benchmark="DDP doctor on public shapes: recall, false alarms, time over a plain run")
    work = Path(tempfile.mkdtemp(prefix="course-bench-doctor-public-"))
    accuracy = accuracy_of(chosen, work / "accuracy") if args.accuracy else {}
    seconds = list(accuracy.get("seconds", {}).values())
    times = {}
    for case in (c for c in chosen if c.group == "correct" and args.timing_repeats):
        times[case.name] = timing(case, work / "timing", args.timing_repeats)
        shown = f"{times[case.name]['ratio']:.1f}x" if "ratio" in times[case.name] else times[case.name]["error"]
        print(f"{case.name}: doctor / plain run {shown}")
    ratios = [t["ratio"] for t in times.values() if "ratio" in t]
    summary = {"median_ratio": round(statistics.median(ratios), 2) if ratios else None,
               "max_ratio": max(ratios) if ratios else None, "timed": len(ratios),
               "median_doctor_s": round(statistics.median(seconds), 1) if seconds else None,
               "max_doctor_s": max(seconds, default=None),
               "within_goal": max(seconds) <= GOAL_SECONDS if seconds else None}
    if ratios:
        print(f"doctor / plain run: median {summary['median_ratio']:.1f}x, max {summary['max_ratio']:.1f}x "
              f"({len(ratios)} scripts)")
    shutil.rmtree(work, ignore_errors=True)
    return log.finish(accuracy=accuracy, timing=times, summary=summary, goal_seconds=GOAL_SECONDS,
                      cases_file=str(CASES.relative_to(ROOT)), cpu_count=os.cpu_count())


if __name__ == "__main__":
    main()
