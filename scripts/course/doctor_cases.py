"""The doctor's test set, read from ``tests/fixtures/doctor/cases.json`` (one place for the tests and the benchmark):
each case a script, its arguments and the findings the doctor must make, no more. ``run_all`` runs the cases two
at a time, each in a working folder of its own; ``score`` counts what was found, missed and found in excess."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from course import ROOT

CASES = ROOT / "tests" / "fixtures" / "doctor" / "cases.json"


@dataclass
class Case:
    name: str
    group: str  # pitfall, exercise, learner, correct, input
    script: Path
    args: list
    expect: list
    options: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # created in the working folder first; must be unchanged after
    bench_only: bool = False  # run by the benchmark, not by the tests


@dataclass
class Outcome:
    case: Case
    report: object  # ddp_doctor.report.Report
    cwd: Path
    folder: Path
    seconds: float

    @property
    def found(self) -> list:
        return sorted(f.code for f in self.report.findings)

    @property
    def missed(self) -> list:
        return sorted(set(self.case.expect) - set(self.found))

    @property
    def extra(self) -> list:
        return sorted(set(self.found) - set(self.case.expect))


def load(path: Path = CASES, bench: bool = True) -> list[Case]:
    """The cases (bench=False: without those only the benchmark runs), each with --steps 4 unless it says."""
    fill = {"{cpus}": str(os.cpu_count() or 1), "{data}": str(ROOT / "data")}  # the doctor runs in a folder of its own

    def filled(arg: str) -> str:
        for key, value in fill.items():
            arg = arg.replace(key, value)
        return arg

    found = [Case(c["name"], c["group"], ROOT / c["script"], [filled(a) for a in c["args"]],
                  c["expect"], {"steps": 4, **c.get("options", {})}, c.get("files", {}), c.get("bench_only", False))
             for c in json.loads(path.read_text())["cases"]]
    return [c for c in found if bench or not c.bench_only]


def run_case(case: Case, root: Path) -> Outcome:
    from ddp_doctor import check

    cwd, folder = root / case.name / "cwd", root / case.name / "doctor"
    cwd.mkdir(parents=True, exist_ok=True)
    for name, text in case.files.items():
        (cwd / name).write_text(text)
    start = time.monotonic()
    report = check(case.script, case.args, cwd=cwd, folder=folder, show=False, **case.options)
    return Outcome(case, report, cwd, folder, time.monotonic() - start)


def run_all(cases: list[Case], root: Path, at_once: int = 2) -> dict[str, Outcome]:
    with ThreadPoolExecutor(at_once) as pool:
        return {o.case.name: o for o in pool.map(lambda c: run_case(c, root), spread(cases))}


def spread(cases: list[Case]) -> list[Case]:
    """The cases in the order they start: those that mostly wait (a hang, ended after ``hang_after`` seconds or at
    the job's timeout) the longest wait first, each followed by its share of the others: two waiting at once would
    leave the cores idle."""
    def wait(case: Case) -> float:
        return min(case.options["hang_after"], case.options.get("timeout", float("inf")))

    waiting = sorted((c for c in cases if "hang_after" in c.options), key=wait, reverse=True)
    busy = [c for c in cases if "hang_after" not in c.options]
    share = len(busy) // max(len(waiting), 1)
    order = [c for i, w in enumerate(waiting) for c in (w, *busy[i * share:(i + 1) * share])]
    return order + busy[len(waiting) * share:]


def score(outcomes: dict[str, Outcome]) -> dict:
    """Recall (expected findings made) and false alarms (findings made that no case expects)."""
    expected = sum(len(o.case.expect) for o in outcomes.values())
    found = sum(len(set(o.case.expect) & set(o.found)) for o in outcomes.values())
    extra = {name: o.extra for name, o in outcomes.items() if o.extra}
    return {"cases": len(outcomes), "expected_findings": expected, "found": found,
            "recall": round(found / expected, 4) if expected else None,
            "false_alarms": sum(map(len, extra.values())), "cases_with_false_alarms": sorted(extra),
            "missed": {name: o.missed for name, o in outcomes.items() if o.missed},
            "clean_cases": sum(1 for o in outcomes.values() if not o.case.expect),
            "seconds": {name: round(o.seconds, 1) for name, o in outcomes.items()}}
