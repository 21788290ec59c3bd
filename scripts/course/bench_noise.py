"""Benchmark: course.measure's rule, both halves, on a busy machine: equal work gets no faster/slower verdict,
and a large difference that every round shows always gets one.

    python -m course.bench_noise [--comparisons 20] [--large 5] [--rounds 5]        (or: make bench)

One core is kept busy by a busy-loop process that this benchmark starts, bounds (--busy-limit seconds) and
ends. Meanwhile a small real workload (a few training steps of a small MLP, 1 thread) is compared with an
identical copy of itself, --comparisons times, each time through course.measure.compare (interleaved
rounds after one untimed round): the goal is not one faster/slower verdict. Then the same workload is
compared with --factor times the work, --large times: the goal is a verdict ("slower") every time.
Every round, verdict and count goes to runs/benchmarks/self_comparison/metrics.json; the exit status is 1
when either goal is missed. Speed-noise goals are measured here, not asserted in a timed test.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Self

from course.args import positive_int, repo_path
from course.measure import MIN_ROUNDS, RULE, SAME_BAND, compare, time_call
from course.runlog import RunLog

BUSY_LOOP = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"
VERDICTS = ("above", "below")  # conclusion() keys that mean faster/slower


class BusyCore:
    """A process spinning on one core, ended on exit (and by itself after ``limit`` seconds at the latest)."""

    def __init__(self, limit: float):
        self.limit = limit
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(limit=self.limit)])
        self.start = time.monotonic()
        return self

    def report(self) -> dict:
        """How busy it kept its core so far: its CPU seconds over the seconds it has been running."""
        import psutil

        wall = time.monotonic() - self.start
        try:
            times = psutil.Process(self.proc.pid).cpu_times()
            cpu = times.user + times.system
        except psutil.NoSuchProcess:
            cpu = None
        return {"pid": self.proc.pid, "alive": self.proc.poll() is None, "wall_s": round(wall, 3),
                "cpu_s": None if cpu is None else round(cpu, 3)}

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def workload(steps: int):
    """A function that runs ``steps`` training steps of a small MLP on a fixed batch; a new model each call
    of workload(), built from the same seed, so two of them are the same work."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))

    def run() -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return run


def seconds(fn) -> float:
    """One round's number: the median seconds of 3 calls after 1 untimed call."""
    return statistics.median(time_call(fn, repeats=3, warmup=1))


def one_comparison(a_steps: int, b_steps: int, rounds: int, names=("A", "A again")) -> dict:
    a, b = workload(a_steps), workload(b_steps)
    result = compare({names[0]: lambda: seconds(a), names[1]: lambda: seconds(b)}, repeats=rounds, warmup=1,
                     unit="s", higher_is_better=False, cpu_only=True)
    judged = result.judge(names[1], names[0])
    return {"values": result.to_dict()["values"], "ratios": judged["ratios"], "margin": judged["margin"],
            "conclusion": result.conclusion(names[1], names[0]),
            "verdict": result.verdict(names[1], names[0], equal_work=a_steps == b_steps)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comparisons", type=positive_int, default=20, help="self-comparisons to run")
    parser.add_argument("--large", type=positive_int, default=5, help="comparisons with --factor times the work")
    parser.add_argument("--factor", type=positive_int, default=10, help="the large difference in work")
    parser.add_argument("--large-steps", type=positive_int, default=25,
                        help="steps of the 1x work in the large comparisons (long enough to outlast a time slice)")
    parser.add_argument("--rounds", type=positive_int, default=MIN_ROUNDS, help="rounds of each comparison")
    parser.add_argument("--steps", type=positive_int, default=4, help="training steps in one timed call")
    parser.add_argument("--busy-limit", type=positive_int, default=300, help="the busy loop ends itself after")
    parser.add_argument("--run-dir", type=repo_path, default="runs/benchmarks/self_comparison")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # one core for the workload, the other for the busy loop (on 2 cores)
    log = RunLog(args.run_dir, benchmark="self-comparison under load", rule=RULE,
                 constants={"MIN_ROUNDS": MIN_ROUNDS, "SAME_BAND": SAME_BAND},
                 workload=f"{args.steps} SGD steps of a 64-256-10 MLP, batch 128, 1 thread (large comparisons: "
                          f"{args.large_steps} against {args.factor * args.large_steps}); "
                          "a round's value: median seconds of 3 calls after 1 untimed")
    with BusyCore(args.busy_limit) as busy:
        time.sleep(0.3)  # let it start spinning
        comparisons = []
        for index in range(args.comparisons):
            comparisons.append(one_comparison(args.steps, args.steps, args.rounds))
            print(f"{index + 1:>3}. {comparisons[-1]['verdict']}", flush=True)
        large = []
        for index in range(args.large):
            large.append(one_comparison(args.large_steps, args.factor * args.large_steps, args.rounds,
                                        names=("1x work", f"{args.factor}x work")))
            print(f"{index + 1:>3}. {large[-1]['verdict']}", flush=True)
        busy_report = busy.report()
    counts = {key: sum(c["conclusion"] == key for c in comparisons) for key in ("above", "below", "same", "noisy")}
    counts["faster_or_slower"] = counts["above"] + counts["below"]
    large_counts = {"slower": sum(c["conclusion"] == "above" for c in large), "of": len(large)}
    goals = {"equal_work_no_verdict": counts["faster_or_slower"] == 0,
             "large_difference_decided": large_counts["slower"] == len(large)}
    share = busy_report["cpu_s"] / busy_report["wall_s"] if busy_report["cpu_s"] and busy_report["wall_s"] else 0
    print(f"busy loop: {share:.0%} of a core for {busy_report['wall_s']:.1f} s")
    print(f"{args.comparisons} self-comparisons of {args.rounds} rounds: {counts['faster_or_slower']} faster/slower, "
          f"{counts['same']} about the same, {counts['noisy']} too noisy or too few "
          f"- goal (0 faster/slower) {'met' if goals['equal_work_no_verdict'] else 'MISSED'}")
    print(f"{args.large} comparisons with {args.factor}x the work: {large_counts['slower']} found slower "
          f"- goal (every one) {'met' if goals['large_difference_decided'] else 'MISSED'}")
    return log.finish(rounds=args.rounds, comparisons=comparisons, large=large, factor=args.factor, counts=counts,
                      large_counts=large_counts, goals=goals, busy=busy_report, busy_core_share=round(share, 3))


if __name__ == "__main__":
    sys.exit(0 if all(main()["goals"].values()) else 1)
