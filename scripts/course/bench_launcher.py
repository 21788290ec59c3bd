"""Benchmark: what the course launcher adds to the wall time of a torchrun job.

    python -m course.bench_launcher [--repeats 5]        (or: make bench)

The same 2-rank job (notebook 00's hello_distributed.py, no timing inside) is run with bare torchrun and
through course.launcher.launch, interleaved and repeated by course.measure.compare. The table and the
verdict are printed and written, with every round, to runs/benchmarks/launcher_overhead/metrics.json.
The launcher adds a thread that reads the output and a 0.1 s poll, so its verdict should be "about the
same" or "no clear difference", never seconds slower. A speed goal is measured here, not asserted in a test.
"""

import argparse
import os
import subprocess
import time

from course import ROOT
from course.args import nonnegative_int, positive_int, repo_path
from course.launcher import launch, plan, torchrun_command
from course.measure import compare
from course.runlog import RunLog

JOB = ("hello_distributed.py", 2)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=5, help="rounds of each configuration")
    parser.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed rounds first")
    parser.add_argument("--run-dir", type=repo_path, default="runs/benchmarks/launcher_overhead")
    args = parser.parse_args(argv)

    script, nproc = JOB
    job_args = ["--max-mib", "0", "--run-dir", args.run_dir / "job"]
    env = {**os.environ, "OMP_NUM_THREADS": str(plan(nproc).threads_per_rank)}  # what launch() gives each rank
    command = [str(part) for part in torchrun_command(script, nproc, job_args)]

    def bare() -> float:
        start = time.monotonic()
        subprocess.run(command, cwd=ROOT, env=env, capture_output=True, check=True, timeout=300)
        return time.monotonic() - start

    def through_launcher() -> float:
        return launch(script, nproc, job_args, timeout=300, on_line=lambda _: None).wall_time

    log = RunLog(args.run_dir, benchmark="launcher overhead", job=f"{script} on {nproc} ranks")
    result = compare({"bare torchrun": bare, "course launcher": through_launcher}, repeats=args.repeats,
                     warmup=args.warmup, unit="s", higher_is_better=False)
    verdict = result.verdict("course launcher", "bare torchrun", what="wall time")
    result.show()
    print(verdict)
    return log.finish(**result.to_dict(), verdict=verdict,
                      conclusion=result.conclusion("course launcher", "bare torchrun"))


if __name__ == "__main__":
    main()
