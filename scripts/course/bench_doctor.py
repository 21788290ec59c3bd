"""Benchmark: how often the DDP doctor is right, and what its recorder costs.

    python -m course.bench_doctor [--repeats 5]        (or: make bench)

Accuracy: every case of the doctor's test set (tests/fixtures/doctor/cases.json: the pitfalls, exercise 6's bugs,
the correct scripts, learner-shaped scripts) is run once; recall is the share of expected findings made, false
alarms the findings no case expects. Cost: a script that only starts (a process group and one all-reduce: the
fixed start-up) and a few of the case scripts, whole (no pass cut), each run three ways, interleaved and repeated by
course.measure.compare: plain on one node (as a learner runs it with torchrun), plain on the doctor's 2 simulated
nodes, and as the doctor runs it (2 nodes, recorded). Recorder cost = doctor / plain on 2 nodes (goal: at most
1.20x); whole cost = doctor / plain on one node, with the seconds it adds, by the script's plain length. The
doctor's own start-up (its Python, about 0.3 s) and its analysis (milliseconds) are not in these times.
Everything goes to runs/benchmarks/doctor/metrics.json.
"""

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from course import ROOT
from course import doctor_cases as cases
from course.args import nonnegative_int, positive_int, repo_path
from course.measure import compare
from course.runlog import RunLog
from ddp_doctor.running import Job, run

# the start-up alone, then whole runs of a few seconds each: a model the doctor records every step of
OVERHEAD = [("tests/fixtures/doctor/startup_only.py", []),
            ("scripts/train_ddp.py", ["--epochs", "1", "--max-steps", "60", "--data-dir", str(ROOT / "data" / "mnist")]),
            ("tests/fixtures/doctor/nanogpt_loop.py", ["--fixed", "--max-iters", "30"]),
            ("tests/fixtures/doctor/trainer_class.py", ["--fixed", "--total-epochs", "3"])]
GOAL = 1.20


def overhead(script: str, args: list, repeats: int, warmup: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="course-bench-doctor-"))
    job = Job(ROOT / script, args, nproc=2, nodes=2, cwd=work, timeout=600, steps=0)
    count = iter(range(10**6))

    def once(which: Job, plain: bool) -> float:
        result = run(which, work / f"run{next(count)}", plain=plain)
        if result.returncode != 0:
            raise RuntimeError(f"{script} failed: {result.failure}")
        return result.seconds

    result = compare({"plain": lambda: once(replace(job, nodes=1), True), "plain 2 nodes": lambda: once(job, True),
                      "doctor": lambda: once(job, False)}, repeats=repeats, warmup=warmup, unit="s",
                     higher_is_better=False)
    median = {name: m.median for name, m in result.measurements.items()}
    ratio = median["doctor"] / median["plain 2 nodes"]
    return {**result.to_dict(), "ratio": round(ratio, 3), "within_goal": ratio <= GOAL,
            "verdict": result.verdict("doctor", "plain 2 nodes", "wall time"),
            "plain_s": round(median["plain"], 2), "doctor_over_plain": round(median["doctor"] / median["plain"], 3),
            "added_s": round(median["doctor"] - median["plain"], 2),
            "verdict_whole": result.verdict("doctor", "plain", "wall time")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=5, help="rounds of each configuration (cost)")
    parser.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed rounds first (cost)")
    parser.add_argument("--run-dir", type=repo_path, default="runs/benchmarks/doctor")
    args = parser.parse_args(argv)
    log = RunLog(args.run_dir, benchmark="DDP doctor: recall, false alarms, recorder cost")
    outcomes = cases.run_all(cases.load(), Path(tempfile.mkdtemp(prefix="course-bench-doctor-")))
    accuracy = cases.score(outcomes)
    print(f"recall {accuracy['found']}/{accuracy['expected_findings']} = {accuracy['recall']:.2f}; false alarms "
          f"{accuracy['false_alarms']} in {accuracy['cases']} cases ({accuracy['clean_cases']} without a mistake)")
    cost = {}
    for script, script_args in OVERHEAD:
        cost[script] = c = overhead(script, script_args, args.repeats, args.warmup)
        print(f"{script}: recorder {c['ratio']:.2f}x plain on the same 2 nodes (goal <= {GOAL:.2f}x; {c['verdict']}); "
              f"whole {c['doctor_over_plain']:.2f}x a plain torchrun run of {c['plain_s']:.1f} s, "
              f"{c['added_s']:+.1f} s ({c['verdict_whole']})")
    by_length = sorted((c["plain_s"], c["added_s"], c["doctor_over_plain"], s) for s, c in cost.items())
    return log.finish(accuracy=accuracy, overhead=cost, goal_ratio=GOAL,
                      cost_by_length=[{"script": s, "plain_s": p, "added_s": a, "doctor_over_plain": r}
                                      for p, a, r, s in by_length])


if __name__ == "__main__":
    main()
