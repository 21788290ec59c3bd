"""Benchmark: how often the DDP doctor is right, and what its recorder costs.

    python -m course.bench_doctor [--repeats 5]        (or: make bench)

Accuracy: every case of the doctor's test set (tests/fixtures/doctor/cases.json: the pitfalls, exercise 6's bugs,
the correct scripts, learner-shaped scripts) is run once; recall is the share of expected findings made, false
alarms the findings no case expects. Cost: a few of those scripts, whole (no pass cut), run plain and under the
recorder on the same processes and nodes, interleaved and repeated by course.measure.compare; the goal is that
the recorder adds at most 20 % to the job's wall time. Everything goes to runs/benchmarks/doctor/metrics.json.
"""

import argparse
import tempfile
from pathlib import Path

from course import ROOT
from course.args import nonnegative_int, positive_int, repo_path
from course.doctor import cases
from course.doctor.running import Job, run
from course.measure import compare
from course.runlog import RunLog

# whole runs of a few seconds each: a model the doctor records every step of
OVERHEAD = [("scripts/train_ddp.py", ["--epochs", "1", "--max-steps", "60"]),
            ("tests/fixtures/doctor/nanogpt_loop.py", ["--fixed", "--max-iters", "30"]),
            ("tests/fixtures/doctor/trainer_class.py", ["--fixed", "--total-epochs", "3"])]
GOAL = 1.20


def overhead(script: str, args: list, repeats: int, warmup: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="course-bench-doctor-"))
    job = Job(ROOT / script, args, nproc=2, nodes=2, cwd=work, timeout=600, steps=0)
    count = iter(range(10**6))

    def once(plain: bool) -> float:
        result = run(job, work / f"run{next(count)}", plain=plain)
        if result.returncode != 0:
            raise RuntimeError(f"{script} failed: {result.failure}")
        return result.seconds

    result = compare({"plain": lambda: once(True), "recorder": lambda: once(False)}, repeats=repeats,
                     warmup=warmup, unit="s", higher_is_better=False)
    ratio = result["recorder"].median / result["plain"].median
    return {**result.to_dict(), "ratio": round(ratio, 3), "verdict": result.verdict("recorder", "plain", "wall time"),
            "within_goal": ratio <= GOAL}


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
        cost[script] = overhead(script, script_args, args.repeats, args.warmup)
        print(f"{script}: recorder/plain wall time {cost[script]['ratio']:.2f}x (goal <= {GOAL:.2f}x); "
              f"{cost[script]['verdict']}")
    return log.finish(accuracy=accuracy, overhead=cost, goal_ratio=GOAL)


if __name__ == "__main__":
    main()
