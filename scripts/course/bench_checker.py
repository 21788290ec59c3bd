"""Benchmark: how often the exercise checker is wrong, over its own test set (``course.exercises.mutations``).

    python -m course.bench_checker [--jobs 2] [--repeat 1] [--only 4 9 ...] [--group held-out] [--case ID ...]
                                   [--timeout S]     (or: make bench)

Every case of the set (a realistic wrong solution, or a correct alternative, of each exercise) is checked as
a learner's script is: ``course.exercises.check`` on a copy in a folder of its own, ``--jobs`` at a time. A
wrong solution that passes is a **false PASS**; a correct alternative that does not pass, a **false FAIL**;
a wrong solution diagnosed as the set names it gets the first hint written for that mistake (**first hint
names the mistake**). With ``--repeat N`` every case runs N times and a case whose diagnosis changes is
**unstable**. Also measured: each check's wall time (median, max) and the processes left behind (none
should be). Printed, and written with every case's diagnosis to runs/benchmarks/checker/metrics.json.

**How "names the mistake" is judged**: every wrong solution of the set declares the kind of mistake it is
(``Case.expect``, a diagnosis id of the checker). Its first rung is ``named`` when the check's diagnosis is that
id (and the rung shown is the first of that diagnosis's ladder); ``generic`` when the diagnosis is one that says
only where to look (``hints.GENERIC``: a crash or a hang not read further, a plain difference); ``misleading``
when it is another specific diagnosis (its first rung names a kind of mistake the script does not have);
``passed`` for a false PASS. Counted per exercise and per group of cases (``Case.group``: the older set, issue
44's kinds, and the held-out set written before the rules for those kinds, reported apart). Issue 55's held-out
set (``held-out-55``) declares no kind (``expect`` "unknown"): its first hints are recorded (``first_hint``) and
classed "to judge", by reading them as a learner would (docs/checker.md gives the judged figures).
The tests hold each case to its diagnosis; this measures the rates, as a course with a grader should.
"""

import argparse
import re
import statistics
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from course.args import positive_int, repo_path
from course.exercises.running import LAUNCH_TIMEOUT_S
from course.runlog import RunLog


def leftover(marker: str) -> int:
    """Live processes whose command line mentions ``marker`` (a checker's folder)."""
    import psutil

    count = 0
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or ()) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return count


def run_case(case, root: Path, attempt: int, timeout: float) -> dict:
    """One check of one case, in its own folder; what it found and how long it took."""
    from course.exercises import EXERCISES, check

    folder = root / f"{re.sub(r'[^a-z0-9]+', '-', case.id.lower())}-{attempt}"
    folder.mkdir(parents=True)
    path = folder / EXERCISES[case.key].script
    path.write_text(case.script())
    start = time.monotonic()
    result = check(case.key, path, work_dir=folder / "work", results_file=folder / "results.json", show=False,
                   timeout=timeout)
    right = result.passed if case.correct else (not result.passed and result.diagnosis == case.expect
                                                and result.hint_level == 1)
    judged = case.expect == UNKNOWN  # a set whose first hints are judged by reading them (issue 55's held-out)
    return {"case": case.id, "exercise": case.key, "expect": case.expect, "class": case.cls,
            "group": case.group or "older", "status": result.status, "diagnosis": result.diagnosis,
            "launched": EXERCISES[case.key].launches, "seconds": round(time.monotonic() - start, 1), "right": right,
            "first_rung": None if case.correct else "passed" if result.passed else "to judge" if judged
            else first_rung(result.passed, result.diagnosis, right),
            "first_hint": "" if result.passed else (result.hint or "")[:600]}


UNKNOWN = "unknown"  # Case.expect of a mistake whose first hint is judged by reading it, not by a diagnosis id


def first_rung(passed: bool, diagnosis: str, right: bool) -> str:
    """The class of a wrong solution's first rung (the module's docstring says how it is judged)."""
    from course.exercises.hints import GENERIC

    if passed:
        return "passed"
    return "named" if right else "generic" if diagnosis in GENERIC else "misleading"


def rates(rows: list[dict]) -> dict:
    """False PASS, false FAIL and first-hint rates of a list of checked cases (the first run of each)."""
    mistakes = [r for r in rows if r["expect"] != "pass"]  # "unknown" ones too: false PASS counts for them
    correct = [r for r in rows if r["expect"] == "pass"]
    false_pass = [r["case"] for r in mistakes if r["status"] == "pass"]
    false_fail = [r["case"] for r in correct if r["status"] != "pass"]
    named = [r for r in mistakes if r["right"]]
    classes = {k: sum(r["first_rung"] == k for r in mistakes)
               for k in ("named", "generic", "misleading", "passed", "to judge")}
    return {"first_rung": classes, "mistakes": len(mistakes), "correct_alternatives": len(correct),
            "false_pass": len(false_pass), "false_pass_rate": round(len(false_pass) / max(len(mistakes), 1), 3),
            "false_fail": len(false_fail), "false_fail_rate": round(len(false_fail) / max(len(correct), 1), 3),
            "first_hint_names_mistake": len(named),
            "first_hint_rate": round(len(named) / max(len(mistakes) - classes["to judge"], 1), 3),
            "false_pass_cases": false_pass, "false_fail_cases": false_fail,
            "misnamed_cases": [f"{r['case']}: {r['diagnosis']} ({r['first_rung']}; expected {r['expect']})" for r in mistakes
                               if not r["right"] and r["status"] != "pass" and r["first_rung"] != "to judge"]}


def main(argv=None) -> dict:
    from course.exercises.mutations import CASES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=positive_int, default=2, help="checks at a time (each launches 2 processes)")
    parser.add_argument("--repeat", type=positive_int, default=1, help="runs of every case (stability)")
    parser.add_argument("--only", nargs="+", metavar="EXERCISE", help="only these exercises' cases (e.g. 4 6a 9)")
    parser.add_argument("--group", nargs="+", choices=("older", "rungs", "held-out", "held-out-55"),
                        help="only these groups of cases (Case.group; older: the set before issue 44)")
    parser.add_argument("--case", nargs="+", metavar="ID", help="only these cases (e.g. '2/a typo')")
    parser.add_argument("--timeout", type=positive_int, default=LAUNCH_TIMEOUT_S,
                        help="wall-clock limit of each check's job, seconds (a loaded machine needs more)")
    parser.add_argument("--run-dir", type=repo_path, default="runs/benchmarks/checker")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if (not args.only or c.key in args.only)
             and (not args.group or (c.group or "older") in args.group) and (not args.case or c.id in args.case)]

    log = RunLog(args.run_dir, benchmark="exercise checker", cases=len(cases), jobs=args.jobs, repeat=args.repeat)
    with tempfile.TemporaryDirectory(prefix="bench_checker_") as tmp:
        root = Path(tmp)
        work = [(c, a) for a in range(args.repeat) for c in cases]
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(lambda item: run_case(item[0], root, item[1], args.timeout), work))
        wall = time.monotonic() - start
        time.sleep(2)  # a rank ended by its launcher may take a moment to go
        left = leftover(str(root))

    first = runs[:len(cases)]
    by_case = defaultdict(set)
    for r in runs:
        by_case[r["case"]].add(r["diagnosis"])
    unstable = sorted(c for c, seen in by_case.items() if len(seen) > 1)
    launched = sorted(r["seconds"] for r in runs if r["launched"])
    per_exercise = {key: {k: v for k, v in rates([r for r in first if r["exercise"] == key]).items()
                          if not k.endswith("_cases")} for key in dict.fromkeys(r["exercise"] for r in first)}
    total = rates(first)
    per_group = {g: {k: v for k, v in rates([r for r in first if r["group"] == g]).items() if not k.endswith("_cases")}
                 for g in dict.fromkeys(r["group"] for r in first)}
    metrics = {**total, "per_exercise": per_exercise, "per_group": per_group, "unstable_cases": unstable, "repeat": args.repeat,
               "check_seconds_median": round(statistics.median(launched), 1) if launched else None,
               "check_seconds_max": max(launched, default=None), "processes_left": left,
               "bench_wall_s": round(wall, 1), "cases": runs}

    print(f"{len(cases)} cases ({total['mistakes']} wrong solutions, {total['correct_alternatives']} correct "
          f"alternatives), {args.repeat} run(s) each, {args.jobs} at a time, {wall:.0f} s")
    print(f"{'exercise':>8}  {'mistakes':>8}  {'first hint names it':>19}  {'generic':>7}  {'misleading':>10}  "
          f"{'false PASS':>10}  {'false FAIL':>10}")
    for key, r in [*per_exercise.items(), *((f"[{g}]", r) for g, r in per_group.items())]:
        print(f"{key:>8}  {r['mistakes']:>8}  {r['first_hint_names_mistake']:>10} ({r['first_hint_rate']:.0%})"
              f"{'':>3}  {r['first_rung']['generic']:>7}  {r['first_rung']['misleading']:>10}  {r['false_pass']:>10}  "
              f"{r['false_fail']:>10}" + (f"  ({r['first_rung']['to judge']} to judge)" if r['first_rung']['to judge'] else ""))
    print(f"all: false PASS {total['false_pass']}/{total['mistakes']}, false FAIL {total['false_fail']}/"
          f"{total['correct_alternatives']}, first hint names the mistake {total['first_hint_names_mistake']}/"
          f"{total['mistakes']} ({total['first_hint_rate']:.0%}); check wall time median "
          f"{metrics['check_seconds_median']} s, max {metrics['check_seconds_max']} s; processes left {left}"
          + (f"; diagnosis changed between runs: {', '.join(unstable)}" if unstable else ""))
    for line in total["false_pass_cases"] + total["false_fail_cases"] + total["misnamed_cases"]:
        print(f"  wrong: {line}")
    for r in first:
        if r["first_rung"] == "to judge":
            print(f"  to judge: {r['case']} ({r['diagnosis']}): {r['first_hint'][:300]}")
    return log.finish(**metrics)


if __name__ == "__main__":
    main()
