"""The figures of ``make bench`` in the documentation pages, written by a program, never copied by hand.

    python -m course.bench_report     # after make bench: runs/benchmarks/*/metrics.json -> docs/benchmarks.json -> pages

Each benchmark writes its rounds and verdicts to ``runs/benchmarks/<name>/metrics.json``, which is not committed.
``collect`` takes from each one present the figures the pages cite, stamps them with the date the file was written,
this machine and the commit checked out (so it runs right after the benchmarks, as ``make bench`` should), and keeps them in ``docs/benchmarks.json`` (committed: a fresh clone has no runs/; a
benchmark not run again keeps its last entry). ``apply`` rewrites every block between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` in README.md and docs/*.md from that file (``render``); a benchmark never run says so in
its block. tests/test_docs.py holds every block equal to its rendering of docs/benchmarks.json, and each entry
equal to the metrics.json it came from wherever that file is present.
"""

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from course import ROOT

DOCS = ROOT / "docs"
FIGURES = DOCS / "benchmarks.json"
BENCH = ROOT / "runs" / "benchmarks"
SOURCES = {"launcher": "launcher_overhead", "noise": "self_comparison", "checker": "checker", "doctor": "doctor",
           "doctor_public": "doctor_public"}  # entry: the folder its bench writes (course.bench_<entry>)
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.DOTALL)
NOT_RUN = ("Not measured yet in this checkout: `make bench` measures it, and `python -m course.bench_report` writes "
           "its figures here.")


# ------------------------------------------------------------------- metrics.json -> the figures the pages cite

def _launcher(m: dict) -> dict:
    return {"rounds": len(m["values"]["bare torchrun"]), "bare_s": round(m["median"]["bare torchrun"], 2),
            "launcher_s": round(m["median"]["course launcher"], 2), "verdict": m["verdict"]}


def _noise(m: dict) -> dict:
    return {"rounds": m["rounds"], "comparisons": len(m["comparisons"]), "decided": m["counts"]["faster_or_slower"],
            "same": m["counts"]["same"], "noisy": m["counts"]["noisy"], "factor": m["factor"],
            "large": m["large_counts"]["of"], "large_decided": m["large_counts"]["slower"]}


def _checker(m: dict) -> dict:
    groups = {g: {"mistakes": r["mistakes"], "named": r["first_hint_names_mistake"], **r["first_rung"]}
              for g, r in m["per_group"].items()}
    return {"cases": m["mistakes"] + m["correct_alternatives"], "mistakes": m["mistakes"],
            "correct": m["correct_alternatives"], "false_pass": m["false_pass"], "false_fail": m["false_fail"],
            "named": m["first_hint_names_mistake"], "generic": m["first_rung"]["generic"],
            "misleading": m["first_rung"]["misleading"], "groups": groups, "jobs": m.get("jobs"),
            **({"to_judge": m["first_rung"]["to judge"]} if m["first_rung"].get("to judge") else {}),
            "repeat": m["repeat"], "unstable": len(m["unstable_cases"]), "check_s_median": m["check_seconds_median"],
            "check_s_max": m["check_seconds_max"], "processes_left": m["processes_left"]}


def _accuracy(a: dict) -> dict:
    return {"cases": a["cases"], "clean_cases": a["clean_cases"], "expected": a["expected_findings"],
            "found": a["found"], "false_alarms": a["false_alarms"]}


def _doctor(m: dict) -> dict:
    from course.doctor_cases import load
    from ddp_doctor.report import LESSONS

    tested = sorted({code for case in load() for code in case.expect})
    cost = [{"script": row["script"], "plain_s": row["plain_s"], "ratio": row["doctor_over_plain"],
             "added_s": row["added_s"], "rounds": len(m["overhead"][row["script"]]["values"]["doctor"]),
             "verdict": m["overhead"][row["script"]]["verdict_whole"]} for row in m["cost_by_length"]]
    recorder = [m["overhead"][row["script"]]["ratio"] for row in m["cost_by_length"]]
    return {**_accuracy(m["accuracy"]), "codes": len(LESSONS), "untested": sorted(set(LESSONS) - set(tested)),
            "cost": cost, "recorder_low": min(recorder), "recorder_high": max(recorder), "goal": m["goal_ratio"]}


def _doctor_public(m: dict) -> dict:
    ratios = [t["ratio"] for t in m["timing"].values() if "ratio" in t]
    rounds = {len(t["values"]["doctor"]) for t in m["timing"].values() if "ratio" in t}
    return {**_accuracy(m["accuracy"]), "median_s": m["summary"]["median_doctor_s"],
            "max_s": m["summary"]["max_doctor_s"], "timed": len(ratios), "rounds": min(rounds, default=0),
            "ratio_median": m["summary"]["median_ratio"], "ratio_low": min(ratios, default=None),
            "ratio_high": max(ratios, default=None)}


EXTRACT = {"launcher": _launcher, "noise": _noise, "checker": _checker, "doctor": _doctor,
           "doctor_public": _doctor_public}


def metrics_path(name: str) -> Path:
    return BENCH / SOURCES[name] / "metrics.json"


def written(path: Path) -> str:
    """When the benchmark wrote ``path`` (UTC, to the minute)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))


def machine() -> str:
    """This machine in a few words: the system, the CPU cores and the GPUs, if any."""
    import torch

    gpus = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
            else "no GPU")
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, {gpus}"


def commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or None


def load() -> dict:
    return json.loads(FIGURES.read_text()) if FIGURES.exists() else {}


def collect() -> list[str]:
    """Take each metrics.json present into docs/benchmarks.json (figures, date, machine, commit); return the names."""
    figures, taken = load(), []
    figures["about"] = ("Written by python -m course.bench_report from runs/benchmarks/*/metrics.json (make bench); "
                        "do not edit: the pages' bench blocks are rendered from it.")
    for name, extract in EXTRACT.items():
        path = metrics_path(name)
        figures.setdefault(name, None)
        if path.exists():
            figures[name] = {"date": written(path), "machine": machine(), "commit": commit(),
                             **extract(json.loads(path.read_text()))}
            taken.append(name)
    FIGURES.parent.mkdir(exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
    return taken


# ------------------------------------------------------------------------------------- the figures -> the text

def _when(e: dict) -> str:
    return f"{e['machine']}, {e['date']}, commit {e['commit'] or 'unknown'}"


def _of(found: int, total: int) -> str:
    return f"{found} of {total}"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _word(verdict: str) -> str:
    """The verdict's conclusion, without its evidence: "slower in every one of 5 rounds, ...", "too noisy to tell"."""
    tail = verdict.split(" - ", 1)[-1]
    return "too few rounds to decide" if "too few" in tail else tail.split(":")[0]


def readme_doctor(f: dict) -> str:
    own, public = f.get("doctor"), f.get("doctor_public")
    if not own:
        return ("How often it is right is measured by `make bench` over its own test set; no run's figures are "
                "recorded in this checkout yet ([how](docs/doctor.md#how-often-it-is-right)).")
    text = (f"On its own test set of {own['cases']} scripts, the last `make bench` found "
            f"{_of(own['found'], own['expected'])} expected mistakes (false alarms: {own['false_alarms']})")
    if public:
        text += (f", and on {public['cases']} scripts in the shapes of public DDP code "
                 f"{_of(public['found'], public['expected'])} (false alarms: {public['false_alarms']})")
    return (text + "; the sets were written by the same people as its rules, so a mistake of yours can still slip "
            "through ([the figures](docs/doctor.md#how-often-it-is-right)).")


def doctor_accuracy(f: dict) -> str:
    own, public = f.get("doctor"), f.get("doctor_public")
    if not own:
        return NOT_RUN
    lines = [f"- **The course's own set** (`tests/fixtures/doctor/cases.json`, `course.bench_doctor`): "
             f"{_of(own['found'], own['expected'])} expected findings made; false alarms: {own['false_alarms']} in "
             f"{own['cases']} cases ({own['clean_cases']} of them without a mistake). Its cases test "
             f"{own['codes'] - len(own['untested'])} of the doctor's {own['codes']} findings"
             + (f"; these have no case in it: {', '.join(f'`{c}`' for c in own['untested'])}." if own["untested"]
                else ".") + f" Measured on {_when(own)}."]
    if public:
        lines.append(f"- **Scripts in the shapes of public code** (`tests/fixtures/doctor_public/`, "
                     f"`course.bench_doctor_public`): {_of(public['found'], public['expected'])} mistakes named; "
                     f"false alarms: {public['false_alarms']} in {public['cases']} cases ({public['clean_cases']} "
                     f"without a mistake); a check took {public['median_s']:g} s median, {public['max_s']:g} s at "
                     f"most. Measured on {_when(public)}.")
    return "\n".join(lines)


def doctor_cost(f: dict) -> str:
    own, public = f.get("doctor"), f.get("doctor_public")
    if not own:
        return NOT_RUN
    rows = ["| script | plain torchrun (1 node) | the doctor | added | rounds | verdict |", "|---|---|---|---|---|---|"]
    rows += [f"| `{Path(c['script']).name}` | {c['plain_s']:.1f} s | {_x(c['ratio'])} | {c['added_s']:+.1f} s | "
             f"{c['rounds']} | {_word(c['verdict'])} |" for c in own["cost"]]
    text = "\n".join(rows) + (
        f"\n\nThe recorder alone, against the same job run plain on the doctor's 2 simulated nodes: "
        f"{_x(own['recorder_low'])} to {_x(own['recorder_high'])} (goal: at most {_x(own['goal'])}). "
        f"Measured on {_when(own)}.")
    if public and public["timed"]:
        from course.measure import MIN_ROUNDS

        shorter = (f"{public['rounds']} round(s) each are too few to say which is faster"
                   if public["rounds"] < MIN_ROUNDS else
                   "on some it took less time than the plain run, which reads every batch"
                   if public["ratio_low"] < 1 else "on every one it took longer than the plain run")
        text += (f"\n\nOn the {public['timed']} fixed scripts of the public shapes ({public['rounds']} interleaved "
                 f"rounds each), the doctor took {_x(public['ratio_median'])} the plain run's wall time (median; "
                 f"{_x(public['ratio_low'])} to {_x(public['ratio_high'])}): {shorter}. Measured on {_when(public)}.")
    return text


GROUPS = {"older": "the first set", "rungs": "the kinds of mistake the hint rules were written for",
          "held-out": "the same kinds, written before those rules and never used to write them",
          "held-out-55": "issue 55's held-out set, judged by reading (below)"}


def checker(f: dict) -> str:
    c = f.get("checker")
    if not c:
        return NOT_RUN
    groups = "; ".join(f"{GROUPS.get(g, g)}, " + (f"{r['mistakes']} first hints recorded" if r.get("to judge") else
                                                   _of(r['named'], r['mistakes'])) for g, r in c["groups"].items())
    judged = c["mistakes"] - c.get("to_judge", 0)  # the wrong solutions that declare the mistake they are
    return (f"Over {c['cases']} cases ({c['mistakes']} wrong solutions, {c['correct']} correct alternatives), "
            f"{c['repeat']} run(s) each, {c['jobs']} checks at a time: {c['false_pass']} false PASS, "
            f"{c['false_fail']} false FAIL; the first hint named the mistake for {_of(c['named'], judged)} "
            f"({c['generic']} generic, {c['misleading']} misleading), by group: {groups}. "
            f"{c['unstable']} case(s) changed diagnosis between runs; {c['processes_left']} process(es) left behind. "
            f"A check took {c['check_s_median']:g} s median, {c['check_s_max']:g} s at most. Measured on {_when(c)}.")


def launcher(f: dict) -> str:
    e = f.get("launcher")
    if not e:
        return NOT_RUN
    return (f"The same 2-rank job, {e['rounds']} interleaved rounds: bare torchrun {e['bare_s']:.2f} s, through the "
            f"course launcher {e['launcher_s']:.2f} s (medians). {e['verdict']}. Measured on {_when(e)}.")


def noise(f: dict) -> str:
    e = f.get("noise")
    if not e:
        return NOT_RUN
    return (f"With one core kept busy, {e['comparisons']} comparisons of a workload with itself ({e['rounds']} rounds "
            f"each) gave {e['decided']} faster/slower verdicts ({e['same']} about the same, {e['noisy']} too noisy "
            f"to tell; goal: 0), and {_of(e['large_decided'], e['large'])} comparisons with {e['factor']}x the "
            f"work were found slower (goal: every one). Measured on {_when(e)}.")


RENDER = {"readme-doctor": readme_doctor, "doctor-accuracy": doctor_accuracy, "doctor-cost": doctor_cost,
          "checker": checker, "launcher": launcher, "noise": noise}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def rendered(text: str, figures: dict) -> str:
    """``text`` with every bench block's body rendered from ``figures`` (an unknown block name is a KeyError)."""
    return BLOCK.sub(lambda m: m[1] + RENDER[m["name"]](figures) + "\n" + m[4], text)


def blocks(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def apply() -> list[str]:
    """Rewrite the bench blocks of README.md and docs/*.md from docs/benchmarks.json; return the pages changed."""
    figures, changed = load(), []
    for page in pages():
        text = page.read_text()
        new = rendered(text, figures)
        if new != text:
            page.write_text(new)
            changed.append(str(page.relative_to(ROOT)))
    return changed


if __name__ == "__main__":
    print("figures taken from: " + (", ".join(collect()) or "no runs/benchmarks/*/metrics.json (kept as they were)"))
    print("rewrote: " + (", ".join(apply()) or "nothing (already equal)"))
    sys.exit(0)
