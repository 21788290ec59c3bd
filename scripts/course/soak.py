"""Run the quick course several times, each round in a fresh clone of this checkout's HEAD, and report each
notebook's status and time per round (issue 51: the course is green every time, under load too).

    python -m course.soak                       # 3 rounds, the last with one busy core beside it (make soak)
    python -m course.soak --rounds 1 --busy 0   # one quiet round

A round clones HEAD into a temporary folder (its runs/ starts empty: nothing of yours is touched), borrows this
checkout's venv and generated data/, runs `COURSE_QUICK=1 COURSE_ANSWER_KEY=1 python -m course.run_notebooks`
there with a time limit, and reads the summary it prints. The figures go to runs/soak/metrics.json.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from course import ROOT, RUNS

ROW = re.compile(r"^\s+(ok  |FAIL)\s+(\d+) s\s+(\S+\.ipynb)$", re.MULTILINE)
BUSY = "while True: pass"  # one core's worth of load, as a learner's other program would be


def one_round(index: int, busy: bool, limit_s: float) -> dict:
    """One quick course in a fresh clone; {notebook: (ok, seconds)}, the round's wall time and its load."""
    folder = tempfile.mkdtemp(prefix=f"course-soak-{index}-")
    clone = os.path.join(folder, "course")
    subprocess.run(["git", "clone", "-q", str(ROOT), clone], check=True)
    os.symlink(ROOT / ".venv", os.path.join(clone, ".venv"))
    for item in (ROOT / "data").iterdir():  # the generated datasets, read only
        if item.is_dir():
            os.symlink(item, os.path.join(clone, "data", item.name))
    env = {**os.environ, "COURSE_QUICK": "1", "COURSE_ANSWER_KEY": "1", "PYTHONPATH": os.path.join(clone, "scripts")}
    loader = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "course.run_notebooks"], check=False, cwd=clone, env=env, text=True,
                              capture_output=True, timeout=limit_s)
        output, timed_out = done.stdout + done.stderr, False
    except subprocess.TimeoutExpired as stopped:
        output, timed_out = (stopped.stdout or b"").decode(errors="replace"), True
    finally:
        if loader:
            loader.kill()
            loader.wait()
    wall = time.monotonic() - start
    rows = {name: {"ok": status.strip() == "ok", "seconds": int(seconds)} for status, seconds, name in ROW.findall(output)}
    shutil.rmtree(folder, ignore_errors=True)
    return {"round": index, "busy_core": busy, "wall_s": round(wall, 1), "timed_out": timed_out,
            "load_average_at_end": [round(x, 1) for x in os.getloadavg()], "notebooks": rows,
            "tail": output[-2000:] if timed_out or not all(r["ok"] for r in rows.values()) else ""}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="quick courses in a row (default 3)")
    parser.add_argument("--busy", type=int, default=1, help="how many of the last rounds run beside a busy core")
    parser.add_argument("--limit-min", type=float, default=60, help="a round's time limit, in minutes")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not 0 <= args.busy <= args.rounds:
        parser.error("--rounds must be at least 1 and --busy between 0 and --rounds")
    expected = len(list((ROOT / "notebooks").glob("*.ipynb")))
    rounds = []
    for index in range(1, args.rounds + 1):
        busy = index > args.rounds - args.busy
        print(f"round {index} of {args.rounds}{' (one busy core beside it)' if busy else ''} ...", flush=True)
        result = one_round(index, busy, args.limit_min * 60)
        rounds.append(result)
        passed = sum(r["ok"] for r in result["notebooks"].values())
        slowest = max(result["notebooks"].items(), key=lambda item: item[1]["seconds"], default=("-", {"seconds": 0}))
        print(f"  {passed} of {expected} notebooks ok in {result['wall_s']:.0f} s; slowest {slowest[0]} "
              f"{slowest[1]['seconds']} s" + ("; the round hit its time limit" if result["timed_out"] else ""),
              flush=True)
        for name, row in result["notebooks"].items():
            if not row["ok"]:
                print(f"  FAILED {name}\n{result['tail']}", flush=True)
    passed = sum(r["ok"] for result in rounds for r in result["notebooks"].values())
    total = expected * len(rounds)
    out = RUNS / "soak"
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"passed": passed, "of": total, "rounds": rounds}, indent=1))
    print(f"{passed}/{total} notebooks ok over {len(rounds)} round(s); figures in {(out / 'metrics.json').relative_to(ROOT)}")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
