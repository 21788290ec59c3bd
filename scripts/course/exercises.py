"""Notebook 09's exercises, checked by running them: the learner's script on 2 processes against a
single-process reference, step by step, answering **pass** or a hint in plain words.

    from course.exercises import check, hint, progress, solution
    check("2")        # launch scripts/ex2_by_hand.py on 2 processes and compare it with the reference
    hint("2")         # the next, more precise hint for exercise 2
    solution("2")     # the reference solution, as a diff against your script
    progress()        # every exercise's status, from runs/09_build_it_yourself/results.json

How a check works: it reads the script (a syntax error or a gap still marked ``...  # TODO`` is reported
without running anything), launches it with ``torchrun`` through ``course.launcher.launch`` under
``course.exercise_runner`` (which records the files each rank writes, the collectives it calls and what
its samplers yield), with a wall-clock limit and a short process-group timeout so that a hang ends in
seconds and no process is left behind. It then rebuilds the same training in this process, on one
process and the CPU (the *reference*), and compares losses and parameters with stated tolerances.
The first difference becomes a *diagnosis*; each diagnosis has hints that go from the symptom to the
tool to use to the cause, one more each time the same mistake is checked again (or ``hint()`` is called),
never the answer on the first try. A crash is reported as such: the failing rank, its error, and the
lines of your script in its traceback.

``COURSE_EXERCISE_SOLUTIONS=1``: every check runs the reference solution instead of your script (that is
how the test suite runs the notebook headless); the results then go to ``runs/09_build_it_yourself/with_solutions/``
and a check that does not pass raises, so that a headless run fails.
"""

import ast
import copy
import io
import json
import math
import os
import re
import runpy
import shutil
import signal
import threading
import time
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice
from pathlib import Path

import torch
from torch import nn

from course import ROOT, RUNS, SCRIPTS
from course.exercise_tasks import WaveNet, lab_datasets, mlp, regression_data, wave_datasets

NOTEBOOK = "09_build_it_yourself"
SOLUTIONS = Path(__file__).parent / "exercise_solutions"
RUNNER = Path(__file__).parent / "exercise_runner.py"
NPROC = 2
PG_TIMEOUT_S = 10  # process-group timeout passed to the scripts: a rank waiting for a partner gives up after it
LAUNCH_TIMEOUT_S = 90  # wall-clock limit of a whole launch (a loop that never ends); pass timeout= to change it
HANG_MESSAGES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                 "doesn't match expected size", "collective mismatch", "Socket Timeout")


def solutions_mode() -> bool:
    """True when COURSE_EXERCISE_SOLUTIONS asks every check to run the reference solution."""
    return os.environ.get("COURSE_EXERCISE_SOLUTIONS", "0") not in ("", "0", "false", "False")


def default_results_file() -> Path:
    return RUNS / NOTEBOOK / ("with_solutions" if solutions_mode() else "") / "results.json"


# ---------------------------------------------------------------------------------------------------------
# Results of a check


@dataclass
class Verdict:
    """What a check found: ``status`` is pass | fail | error | not solved; ``diagnosis`` names the mistake."""

    status: str
    diagnosis: str
    symptom: str
    facts: dict = field(default_factory=dict)


@dataclass
class CheckResult:
    exercise: str
    status: str
    diagnosis: str
    symptom: str
    hint: str
    hint_level: int
    seconds: float
    script: str
    facts: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def __repr__(self) -> str:
        return f"CheckResult(exercise={self.exercise!r}, status={self.status!r}, diagnosis={self.diagnosis!r})"

    def _ipython_display_(self) -> None:
        """A notebook shows nothing more for a result: check() has printed the report already."""

    def report(self) -> str:
        ex = EXERCISES[self.exercise]
        head = f"Exercise {self.exercise} · {ex.title} — {self.script}, {self.seconds:.1f} s"
        if self.passed:
            return f"{head}\nPASS: {self.symptom}"
        word = {"not solved": "not solved yet", "error": "error", "fail": "not yet"}[self.status]
        lines = [head, f"{word}: {self.symptom}"]
        if self.hint:
            lines.append(f"Hint {self.hint_level}/{len(ex.hints_for(self.diagnosis))}: {self.hint}")
        if self.status != "not solved":
            last = self.hint_level >= len(ex.hints_for(self.diagnosis))
            lines.append(f"(hint('{self.exercise}') for the next hint" if not last else
                         f"(no more hints for this; solution('{self.exercise}') shows the reference solution")
            lines[-1] += f"; the job's whole output: {self.facts['output']})" if self.facts.get("output") else ")"
        return "\n".join(lines)


class Results:
    """The results file: per exercise, the last status and how often each mistake was seen (for the hints)."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else default_results_file()
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.data.setdefault("exercises", {})

    def entry(self, key: str) -> dict:
        return self.data["exercises"].setdefault(key, {"checks": 0, "seen": {}, "extra_hints": {}})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


# ---------------------------------------------------------------------------------------------------------
# The exercises


@dataclass
class Exercise:
    key: str
    title: str
    script: str
    check: Callable
    hints: dict
    launches: bool = True  # False: checked in this process (exercise 3)

    def hints_for(self, diagnosis: str) -> list[str]:
        return self.hints.get(diagnosis) or COMMON_HINTS.get(diagnosis) or COMMON_HINTS["differs"]


def _rel(path) -> str:
    path = Path(path)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def check(exercise: str | int, script: str | os.PathLike | None = None, *, work_dir=None, results_file=None,
          backend: str = "gloo", timeout: float = LAUNCH_TIMEOUT_S, show: bool = True) -> CheckResult:
    """Check one exercise; print and return the result. Never raises for a wrong or broken script
    (except in COURSE_EXERCISE_SOLUTIONS mode, where anything but a pass raises AssertionError).

    script: the file to check (default: the exercise's file in scripts/); work_dir: where its run writes
    (default: runs/09_build_it_yourself/ex<N>); results_file: where statuses and hint levels are kept.
    """
    key = str(exercise)
    if key not in EXERCISES:
        raise ValueError(f"no exercise {key!r}; there are {', '.join(EXERCISES)}")
    ex = EXERCISES[key]
    note = ""
    if script is None and solutions_mode():
        path = SOLUTIONS / ex.script
        note = f"COURSE_EXERCISE_SOLUTIONS=1: checking the reference solution instead of scripts/{ex.script}"
    else:
        path = Path(script) if script is not None else SCRIPTS / ex.script
    results = Results(results_file)
    base = default_results_file().parent if results_file is None else Path(results_file).parent
    work = (Path(work_dir) if work_dir else base / f"ex{key}").resolve()
    if show and note:
        print(note)
    start = time.monotonic()
    verdict = _static_check(ex, path)
    if verdict is None:
        if show and ex.launches:
            print(f"running {_rel(path)} on {NPROC} processes and the single-process reference ...", flush=True)
        try:
            verdict = ex.check(path, work, backend=backend, timeout=timeout)
        except _Stop as stop:
            verdict = stop.verdict
    seconds = time.monotonic() - start
    if verdict.facts.get("launched") and (work / "output.txt").exists():
        verdict.facts["output"] = _rel(work / "output.txt")

    entry = results.entry(key)
    entry["checks"] += 1
    level = 0
    hint_text = ""
    if verdict.status == "not solved":
        hint_text = ex.hints_for(verdict.diagnosis)[0]
        level = 1
    elif verdict.status != "pass":
        seen = entry["seen"][verdict.diagnosis] = entry["seen"].get(verdict.diagnosis, 0) + 1
        hints = ex.hints_for(verdict.diagnosis)
        level = min(seen + entry["extra_hints"].get(verdict.diagnosis, 0), len(hints))
        hint_text = hints[level - 1]
    entry.update(status=verdict.status, diagnosis=verdict.diagnosis, symptom=verdict.symptom,
                 seconds=round(seconds, 1), when=datetime.now().isoformat(timespec="seconds"),
                 script=_rel(path), hint_level=level, solutions=bool(note))
    if verdict.status == "pass":
        entry["passed_once"] = True
    results.save()
    result = CheckResult(key, verdict.status, verdict.diagnosis, verdict.symptom, hint_text, level, seconds,
                         _rel(path), verdict.facts)
    if show:
        print(result.report(), flush=True)
    if note and not result.passed:
        raise AssertionError(f"the reference solution of exercise {key} did not pass: {verdict.symptom}")
    return result


def hint(exercise: str | int, results_file=None) -> str:
    """Print every hint given so far for the exercise's last mistake, plus the next one."""
    key = str(exercise)
    ex = EXERCISES[key]
    results = Results(results_file)
    entry = results.entry(key)
    diagnosis = entry.get("diagnosis")
    if not diagnosis or entry.get("status") == "pass":
        text = (f"Exercise {key}: nothing to hint at" + (" — it passes." if entry.get("status") == "pass" else
                f" yet: run check('{key}') first."))
        print(text)
        return text
    hints = ex.hints_for(diagnosis)
    if entry.get("status") == "not solved":
        shown = 1
    else:
        entry["extra_hints"][diagnosis] = entry["extra_hints"].get(diagnosis, 0) + 1
        shown = min(entry["seen"].get(diagnosis, 0) + entry["extra_hints"][diagnosis], len(hints))
        entry["hint_level"] = shown
        results.save()
    lines = [f"Exercise {key} · {ex.title}: {entry.get('symptom', '')}"]
    lines += [f"Hint {i + 1}/{len(hints)}: {h}" for i, h in enumerate(hints[:shown])]
    if shown >= len(hints) and entry.get("status") != "not solved":
        lines.append(f"That was the last hint: solution('{key}') shows the reference solution.")
    text = "\n".join(lines)
    print(text)
    return text


def solution(exercise: str | int, script: str | os.PathLike | None = None):
    """Show the reference solution as a diff from your script (scripts/<name>) to it; returns its path."""
    from course.scriptdiff import script_diff

    ex = EXERCISES[str(exercise)]
    ref = SOLUTIONS / ex.script
    mine = Path(script) if script else SCRIPTS / ex.script
    print(f"Reference solution: {_rel(ref)}" + (f"\nLines starting with - are in your {_rel(mine)}, "
                                                  "lines starting with + in the solution:" if mine.exists() else ""))
    if not mine.exists():
        print(ref.read_text())
        return ref
    diff = script_diff(mine, ref, marker=r"(?!)", context=2)
    try:
        from IPython import get_ipython
        in_notebook = get_ipython() is not None
    except ImportError:
        in_notebook = False
    if in_notebook:
        diff.show()
    else:
        print(diff.text())
    return ref


def progress(results_file=None) -> None:
    """Show the status of every exercise: a table in a notebook, text elsewhere."""
    results = Results(results_file)
    _show_table(progress_rows(results_file), results.path)


def progress_rows(results_file=None) -> list[dict]:
    """The status of every exercise, as read from the results file."""
    results = Results(results_file)
    rows = []
    for key, ex in EXERCISES.items():
        entry = results.data["exercises"].get(key, {})
        rows.append({"exercise": key, "title": ex.title, "status": entry.get("status", "not tried"),
                     "checks": entry.get("checks", 0), "last result": entry.get("symptom", "")[:110],
                     "when": entry.get("when", "")})
    return rows


def _show_table(rows, path) -> None:
    mark = {"pass": "✅ pass", "fail": "❌ not yet", "error": "❌ error", "not solved": "… not solved yet",
            "not tried": "· not tried"}
    done = sum(r["status"] == "pass" for r in rows)
    title = f"{done} of {len(rows)} checks pass (exercise 6 has three; read from {_rel(path)})"
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
        if get_ipython() is None:
            raise ImportError
    except ImportError:
        print(title)
        for r in rows:
            print(f"  {r['exercise']:>3}  {r['title']:<38} {mark[r['status']]:<18} {r['checks']:>3} checks  {r['when']}")
        return
    import html
    cells = "".join(
        f"<tr><td>{r['exercise']}</td><td style='text-align:left'>{html.escape(r['title'])}</td>"
        f"<td style='text-align:left'>{mark[r['status']]}</td><td>{r['checks']}</td>"
        f"<td style='text-align:left'>{html.escape(r['last result'])}</td><td>{r['when'].replace('T', ' ')}</td></tr>"
        for r in rows)
    display(HTML(f"<b>{html.escape(title)}</b><table><tr><th>#</th><th>exercise</th><th>status</th><th>checks</th>"
                 f"<th style='text-align:left'>last result</th><th>when</th></tr>{cells}</table>"))


# ---------------------------------------------------------------------------------------------------------
# Reading and running the learner's script


class _Stop(Exception):
    """Raised inside a check to end it with a verdict."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.symptom)
        self.verdict = verdict


def _fail(diagnosis: str, symptom: str, status: str = "fail", **facts):
    raise _Stop(Verdict(status, diagnosis, symptom, facts))


def _gaps(text: str) -> list[tuple[int, str]]:
    """(line, comment) of every `...` in the code (not in a string) followed by a `# TODO` comment on its line."""
    ellipsis, todo = set(), {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string == "...":
                ellipsis.add(tok.start[0])
            elif tok.type == tokenize.COMMENT and re.match(r"#\s*TODO", tok.string):
                todo[tok.start[0]] = re.sub(r"^#\s*TODO\s*", "", tok.string)
    except (tokenize.TokenError, SyntaxError):
        return []
    return [(line, todo[line]) for line in sorted(ellipsis & set(todo))]


def _static_check(ex: Exercise, path: Path) -> Verdict | None:
    """A missing file, a syntax error or gaps left: reported without running anything."""
    if not path.exists():
        return Verdict("not solved", "missing", f"{_rel(path)} does not exist: run the %%writefile cell above first.")
    text = path.read_text()
    try:
        ast.parse(text, filename=str(path))
    except SyntaxError as error:
        line = (error.text or "").rstrip("\n")
        caret = " " * (max(error.offset or 1, 1) - 1 + 4) + "^"
        return Verdict("error", "syntax", f"SyntaxError in {path.name}, line {error.lineno}: {error.msg}\n"
                                          f"    {line.strip()}\n{caret if line == line.lstrip() else ''}".rstrip())
    gaps = _gaps(text)
    if gaps:
        listed = "".join(f"\n    line {i:>3}  {todo}" for i, todo in gaps)
        return Verdict("not solved", "gaps", f"{len(gaps)} gap(s) still marked `...  # TODO`:{listed}")
    return None


@dataclass
class Run:
    returncode: int | None  # None: stopped at the wall-clock limit
    output: str
    records: dict  # rank -> what exercise_runner recorded
    out: Path
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _launch(path: Path, args, work: Path, backend: str, timeout: float) -> Run:
    from course.launcher import LaunchError, launch

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    lines: list[str] = []
    start = time.monotonic()
    try:
        result = launch(RUNNER, NPROC, [path.resolve(), *map(str, args), "--out", work, "--timeout", PG_TIMEOUT_S],
                        backend=backend, env={"COURSE_EXERCISE_OUT": str(work)}, timeout=timeout, check=False,
                        quiet=True, on_line=lines.append, allow_oversubscribe=True)  # a 1-core box: slow, still right
        code = result.returncode
    except LaunchError:
        code = None
    output = "".join(lines)
    (work / "output.txt").write_text(output)
    records = {}
    for f in work.glob("runner_rank*.json"):
        try:
            records[int(f.stem.removeprefix("runner_rank"))] = json.loads(f.read_text())
        except ValueError:
            pass
    return Run(code, output, records, work, time.monotonic() - start)


RANK_TAG = re.compile(r"^(?:\[rank(\d+)\]:)+ ?")


def _rank_lines(output: str) -> dict[int, list[str]]:
    """Each rank's own output lines (torchrun's --tee tags them [rankN]:), tags removed."""
    ranks: dict[int, list[str]] = {}
    for line in output.splitlines():
        m = RANK_TAG.match(line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(line[m.end():])
    return ranks


@dataclass
class Crash:
    rank: int
    error: str  # the exception line, shortened
    frames: list[tuple[int, str, str]]  # (line number, function, code) in the learner's script


def _crashes(output: str, path: Path) -> list[Crash]:
    """Per rank, the last Python traceback in its output: the error and the frames in the learner's script."""
    found = []
    name = str(path.resolve())
    for rank, lines in sorted(_rank_lines(output).items()):
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
        if not starts:
            fatal = [line for line in lines if "terminate called" in line or line.lstrip().startswith("what():")]
            if fatal:
                found.append(Crash(rank, _short(fatal[-1].strip()), []))
            continue
        block = lines[starts[-1] + 1:]
        frames, error = [], ""
        for i, line in enumerate(block):
            m = re.match(r'\s*File "([^"]+)", line (\d+), in (.+)', line)
            if m:
                if m.group(1) == name:
                    code = block[i + 1].strip() if i + 1 < len(block) else ""
                    frames.append((int(m.group(2)), m.group(3), code))
            elif line and not line.startswith(" ") and not line.startswith("During handling"):
                error = line.strip()
                break
        found.append(Crash(rank, _short(error), frames))
    return found


def _short(error: str, width: int = 220) -> str:
    error = re.sub(r"\[/[^\]]+\.(cc|cpp|h):\d+\] ", "", error)  # gloo's source location
    error = error.split(". This is typically caused")[0]
    return error if len(error) <= width else error[:width] + " [...]"


def _where(crash: Crash, path: Path) -> str:
    if not crash.frames:
        return ""
    line, func, code = crash.frames[-1]
    return f"{path.name} line {line}" + (f" (in {func})" if func not in ("<module>", "main") else "") + f": `{code}`"


def _failure(run: Run, path: Path, timeout: float) -> None:
    """Turn a failed or stopped run into a verdict: a hang (ranks waiting for each other) or a crash."""
    if run.ok:
        return
    crashes = _crashes(run.output, path)
    if run.returncode is None and not crashes:
        _fail("hang", f"the job was still running after {timeout:.0f} s and was stopped (every process ended): "
                      "a loop that never ends, or a rank waiting for a partner.", status="error", launched=True)
    hang = [c for c in crashes if any(m in c.error for m in HANG_MESSAGES)]
    if hang:
        waited = [c for c in crashes if "Timed out" in c.error]
        parts = [f"rank {c.rank} {'waited' if c in waited else 'failed'} at "
                 f"{_where(c, path) or 'a line outside your script'}" + ("" if c in waited else f" ({c.error})")
                 for c in crashes]
        lead = (f"the job hung: a rank waited in a collective that the other never joined, until the {PG_TIMEOUT_S} s "
                "process-group timeout" if waited else "a collective of one rank was not matched by the other")
        _fail("hang", f"{lead}. " + "; ".join(parts) + ".", status="error", launched=True, crashes=len(crashes))
    if crashes:
        root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", run.output, re.DOTALL)  # torchrun: first failure
        first = next((c for c in crashes if root and c.rank == int(root.group(1)) and c.error), crashes[0])
        where = _where(first, path)
        _fail("crash", f"rank {first.rank} crashed" + (f" at {where}" if where else "") + f": {first.error}",
              status="error", launched=True)
    tail = " | ".join(run.output.strip().splitlines()[-3:])
    _fail("crash", f"the job failed with exit code {run.returncode}: {_short(tail)}", status="error", launched=True)


def _load_trace(run: Run, rank: int) -> dict:
    path = run.out / f"trace_rank{rank}.pt"
    if not path.exists():
        _fail("no-trace", f"rank {rank} wrote no {path.name}: the script must keep its `trace.save()` at the end.",
              launched=True)
    return torch.load(path, weights_only=True)


# ---------------------------------------------------------------------------------------------------------
# Comparing with the reference

ATOL, RTOL = 1e-5, 1e-4  # |yours - reference| <= ATOL + RTOL * |reference|: float32 rounding of a different
# summation order is ~1e-7 here; every mistake the checks look for is far larger.
TOLERANCE = f"|Δ| ≤ {ATOL:g} + {RTOL:g}·|reference|"


def _close(a, b) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return a.shape == b.shape and bool(((a - b).abs() <= ATOL + RTOL * b.abs()).all())


def _maxdiff(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max()) if a.numel() else 0.0


def _flat(params) -> torch.Tensor:
    return torch.cat([torch.as_tensor(p, dtype=torch.float64).flatten() for p in params])


def _update_ratio(before, after, ref_after) -> float:
    """How far a step moved the parameters compared with the reference step from the same point."""
    mine, ref = _flat(after) - _flat(before), _flat(ref_after) - _flat(before)
    return float(mine @ ref / (ref @ ref)) if float(ref @ ref) > 0 else float("nan")


@dataclass
class Trajectory:
    """A training run of the reference (or of a simulated mistake): losses, parameters, validation."""

    names: list
    params: list  # parameters at step 0, 1, ... (lists of tensors)
    losses: list  # global loss of each step (mean over the ranks' losses)
    rank_losses: list  # per step, each simulated rank's own loss
    val: tuple = ()


def _simulate(build, data, loss_fn, *, world=1, per_rank=32, epochs=1, steps=None, lr=0.1, momentum=0.0,
              optimizer="sgd", seed=0, sampler="distributed", set_epoch=True, average=True, accum=1,
              loss_scale=1.0, val=None, val_fn=None) -> Trajectory:
    """Train ``world`` simulated ranks in this process, on the CPU, as a data-parallel script would.

    world=1 with the global batch is the single-process reference. sampler: "distributed" (every rank
    takes every world-th index of a seeded permutation, new with each epoch if set_epoch), "same" (no
    sharding: every rank the whole permutation), "fixed" (no shuffle: global batch k is samples
    [k*B, (k+1)*B), rank r takes every world-th of it). average=False: the ranks never share gradients.
    """
    torch.manual_seed(seed)
    model0 = build()
    models = [model0] + [copy.deepcopy(model0) for _ in range(world - 1)]
    if optimizer == "adam":
        opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in models]
    else:
        opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    x_all, y_all = data.tensors
    n = len(x_all)
    traj = Trajectory([name for name, _ in model0.named_parameters()],
                      [[p.detach().clone() for p in model0.parameters()]], [], [])
    micro = per_rank
    for epoch in range(epochs):
        if sampler == "fixed":
            order = torch.arange(n)
        else:
            g = torch.Generator().manual_seed(seed + (epoch if set_epoch else 0))
            order = torch.randperm(n, generator=g)
        shards = [order[r::world] for r in range(world)] if sampler in ("distributed", "fixed") else [order] * world
        if sampler == "fixed":  # global batch k = samples [kB, (k+1)B); rank r takes every world-th of it
            gb = per_rank * world
            shards = [torch.cat([order[k * gb:(k + 1) * gb][r::world] for k in range(n // gb)]) for r in range(world)]
        n_steps = len(shards[0]) // (micro * accum)
        if steps is not None:
            n_steps = min(n_steps, steps - len(traj.losses))
        for k in range(n_steps):
            step_losses = [0.0] * world
            for m, o in zip(models, opts):
                o.zero_grad()
            for a in range(accum):
                for r, m in enumerate(models):
                    idx = shards[r][(k * accum + a) * micro:(k * accum + a + 1) * micro]
                    loss = loss_fn(m(x_all[idx]), y_all[idx])
                    (loss * loss_scale / accum).backward()
                    step_losses[r] += loss.item() / accum
            if average and world > 1:
                for ps in zip(*(m.parameters() for m in models)):
                    mean = torch.stack([p.grad for p in ps]).mean(0)
                    for p in ps:
                        p.grad.copy_(mean)
            for o in opts:
                o.step()
            traj.losses.append(sum(step_losses) / world)
            traj.rank_losses.append(step_losses)
            traj.params.append([p.detach().clone() for p in model0.parameters()])
        if steps is not None and len(traj.losses) >= steps:
            break
    if val is not None and val_fn is not None:
        with torch.no_grad():
            traj.val = val_fn(model0, val)
    return traj


def _wave_val(model, val):
    x, y = val.tensors
    return int((model(x).argmax(1) == y).sum()), len(y)


def _mse_val(model, val):
    x, y = val.tensors
    return float(nn.functional.mse_loss(model(x), y, reduction="sum")), len(y)


# ---------------------------------------------------------------------------------------------------------
# Exercise 1: convert a single-device script to DDP

EX1 = {"epochs": 3, "per_rank": 16, "lr": 0.5, "momentum": 0.9, "seed": 0}


def _ex1_reference(world: int = 1, **changes) -> Trajectory:
    """world=1: the single-device script at the global batch; world=NPROC: simulated ranks (for the hints)."""
    train, val = wave_datasets()
    cfg = {**EX1, **changes}
    per_rank = cfg.pop("per_rank") * (NPROC if world == 1 else 1)
    return _simulate(WaveNet, train, nn.functional.cross_entropy, world=world, per_rank=per_rank, val=val,
                     val_fn=_wave_val, **cfg)


def _check_convert(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    run = _launch(path, ["--epochs", EX1["epochs"], "--batch-size", EX1["per_rank"], "--lr", EX1["lr"],
                         "--seed", EX1["seed"]], work, backend, timeout)
    _failure(run, path, timeout)
    log, ckpt = work / "log.jsonl", work / "model.pt"
    writers = {f: sorted(r for r, rec in run.records.items() if str(f.resolve()) in rec["writes"])
               for f in (log, ckpt)}

    def one_writer():
        for f, ranks in writers.items():
            if len(ranks) > 1:
                _fail("every-rank-writes", f"{f.name} was written by {len(ranks)} processes (ranks "
                      f"{', '.join(map(str, ranks))}): they overwrite each other's file.", launched=True)

    for f, ranks in writers.items():
        if not ranks or not f.exists():
            _fail("no-output", f"no process wrote {f.name} in the --out folder ({_rel(work)}).", launched=True)
    try:  # the numbers first (the training itself); who writes comes after, unless the log is torn
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except ValueError:
        one_writer()
        _fail("log-unreadable", f"{log.name} is not one JSON record per line.", launched=True)
    steps = [r for r in records if "loss" in r]
    vals = [r for r in records if "val_total" in r]
    ref = _ex1_reference()
    n = len(ref.losses)
    if len(steps) != n:
        facts = (f"the log has {len(steps)} steps, the single-device run {n} ({EX1['epochs']} epochs of global "
                 f"batches of {EX1['per_rank'] * NPROC})")
        if len(steps) == 2 * n:
            _fail("no-sharding", f"{facts}: each process went through the whole training set.", launched=True)
        _fail("steps", f"{facts}.", launched=True)
    losses = [r["loss"] for r in steps]
    if not _close(losses, ref.losses):
        first = next(i for i, (a, b) in enumerate(zip(losses, ref.losses)) if not _close(a, b))
        symptom = (f"the logged loss differs from the single-device run from step {first} on "
                   f"(yours {losses[first]:.6f}, reference {ref.losses[first]:.6f}; tolerance {TOLERANCE})")
        if _close(losses, [r[0] for r in _ex1_reference(world=NPROC).rank_losses]):
            _fail("local-loss", symptom + ": your numbers are rank 0's own loss, of half the batch.", launched=True)
        if _close(losses, _ex1_reference(world=NPROC, set_epoch=False).losses):
            per_epoch = n // EX1["epochs"]
            _fail("no-set-epoch", symptom + f"; steps 0-{per_epoch - 1} (epoch 0) match, and from step {per_epoch} "
                  "on your numbers are those of a run whose every epoch repeats epoch 0's order.", launched=True)
        alone = _ex1_reference(world=NPROC, average=False)
        if _close(losses, [r[0] for r in alone.rank_losses]) or _close(losses, alone.losses):
            _fail("not-averaged", symptom + "; your numbers are those of ranks that each train alone on their "
                  "own half, never sharing gradients.", launched=True)
        _fail("loss-differs", symptom + ".", launched=True)
    one_writer()
    state = torch.load(ckpt, weights_only=True)
    keys = list(state)
    if any(k.startswith("module.") for k in keys):
        _fail("module-prefix", f"the checkpoint's keys start with `module.` ({keys[0]}): a single-device "
              "WaveNet cannot load it as it is.", launched=True)
    if keys != ref.names or not all(_close(state[k], p) for k, p in zip(keys, ref.params[-1])):
        _fail("params-differ", f"the checkpoint's parameters are not those of the single-device run after {n} steps "
              f"(keys {keys[:3]}...).", launched=True)
    if len(vals) != 1:
        _fail("val-missing", f"the log has {len(vals)} validation records; it should end with exactly one.", launched=True)
    correct, total = vals[0]["val_correct"], vals[0]["val_total"]
    ref_correct, ref_total = ref.val
    if total != ref_total:
        why = {ref_total * NPROC: "every sample was counted twice: each rank evaluated the whole set",
               math.ceil(ref_total / NPROC) * NPROC: "one sample was counted twice: the split was padded",
               math.ceil(ref_total / NPROC): "only rank 0's part was counted",
               ref_total // NPROC: "only one rank's part was counted"}.get(total, "")
        diag = {ref_total * NPROC: "val-twice", math.ceil(ref_total / NPROC) * NPROC: "val-padded"}.get(
            total, "val-partial" if total < ref_total else "val-count")
        _fail(diag, f"validation counted {total} samples, the validation set has {ref_total}"
              + (f": {why}." if why else "."), launched=True)
    if correct != ref_correct:
        _fail("val-count", f"validation: {correct}/{total} correct, the single-device model gets "
              f"{ref_correct}/{ref_total}.", launched=True)
    loss_diff = _maxdiff(losses, ref.losses)
    param_diff = max(_maxdiff(state[k], p) for k, p in zip(keys, ref.params[-1]))
    writer = next(r for r, rec in run.records.items() if str(log.resolve()) in rec["writes"])
    return Verdict("pass", "pass", f"{n} steps on {NPROC} processes × 16 = the single-device run's batch of 32: "
                   f"every logged loss and the final parameters equal (max |Δ| {loss_diff:.1e} and {param_diff:.1e}; "
                   f"{TOLERANCE}); log and checkpoint written by rank {writer} only; validation {correct}/{total}, "
                   "each sample counted once.", {"launched": True, "seconds_run": round(run.seconds, 1)})


# ---------------------------------------------------------------------------------------------------------
# Exercise 2: DDP by hand (broadcast, then all_reduce-average every gradient)

EX2 = {"steps": 10, "batch": 32, "lr": 0.1, "seed": 0}


def _ex2_reference(world: int = 1) -> Trajectory:
    data = regression_data(EX2["steps"] * EX2["batch"], seed=EX2["seed"])
    return _simulate(lambda: mlp(8, 32, 32, 1), data, nn.functional.mse_loss, world=world,
                     per_rank=EX2["batch"] // world, steps=EX2["steps"], lr=EX2["lr"], seed=EX2["seed"], sampler="fixed")


def _check_by_hand(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    run = _launch(path, ["--steps", EX2["steps"], "--batch-size", EX2["batch"], "--lr", EX2["lr"],
                         "--seed", EX2["seed"]], work, backend, timeout)
    _failure(run, path, timeout)
    return _compare_traces(run, _ex2_reference(), "every step", loss_ref=_ex2_reference(NPROC))


def _compare_traces(run: Run, ref: Trajectory, what: str, *, loss_ref: Trajectory | None = None) -> Verdict:
    """Both ranks' parameters at step 0, 1, ... against the reference's; the first difference diagnosed."""
    traces = [_load_trace(run, r) for r in range(NPROC)]
    n = len(ref.params) - 1
    for r, t in enumerate(traces):
        if len(t["params"]) != n + 1:
            _fail("steps", f"rank {r} recorded {len(t['params']) - 1} steps, the reference made {n}.", launched=True)
    names = traces[0]["names"]
    p0 = [t["params"][0] for t in traces]
    if not all(_close(a, b) for a, b in zip(p0[0], p0[1])):
        diff = max(_maxdiff(a, b) for a, b in zip(p0[0], p0[1]))
        _fail("no-broadcast", f"at step 0, before any training, rank 1's parameters differ from rank 0's "
              f"(max |Δ| {diff:.2g}): the copies start from different weights.", launched=True)
    if not all(_close(a, b) for a, b in zip(p0[0], ref.params[0])):
        _fail("wrong-start", "at step 0 both ranks hold the same parameters, but not rank 0's initial weights "
              "(the reference starts from those).", launched=True)
    for k in range(1, n + 1):
        mine = [t["params"][k] for t in traces]
        ok = [all(_close(a, b) for a, b in zip(m, ref.params[k])) for m in mine]
        if all(ok):
            continue
        same = all(_close(a, b) for a, b in zip(mine[0], mine[1]))
        if not same:
            bad = [nm for nm, a, b in zip(names, mine[0], mine[1]) if not _close(a, b)]
            _fail("ranks-differ", f"after step {k} the ranks' copies differ ({len(bad)} of {len(names)} parameters: "
                  f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}); before it they were equal.", launched=True)
        ratio = _update_ratio(traces[0]["params"][k - 1], mine[0], ref.params[k])
        facts = {"launched": True, "ratio": ratio, "step": k}
        if abs(ratio - NPROC) < 0.02 * NPROC:
            _fail("summed", f"after step {k} both ranks agree, but the step moved the parameters {ratio:.2f}× as far "
                  "as the reference step from the same point.", **facts)
        if abs(ratio - 1 / NPROC) < 0.02:
            _fail("halved", f"after step {k} both ranks agree, but the step moved the parameters {ratio:.2f}× as far "
                  "as the reference step from the same point.", **facts)
        worst = max(_maxdiff(a, b) for a, b in zip(mine[0], ref.params[k]))
        _fail("differs", f"after step {k} both ranks agree with each other but not with the reference (max |Δ| "
              f"{worst:.2g}; the step is {ratio:.2f}× the reference's; {TOLERANCE}).", **facts)
    worst = max(_maxdiff(a, b) for t in traces for m, rp in zip(t["params"], ref.params) for a, b in zip(m, rp))
    if loss_ref is not None:  # each rank records the loss of its own share of the batch
        for r, t in enumerate(traces):
            mine, want = t["losses"], [rl[r] for rl in loss_ref.rank_losses]
            if not _close(mine, want):
                _fail("loss-differs", f"the parameters match, but rank {r}'s recorded losses do not (first: "
                      f"{mine[0]:.6f} vs {want[0]:.6f}).", launched=True)
    return Verdict("pass", "pass", f"{n} steps: both ranks' parameters equal the single-process reference "
                   f"({what}, max |Δ| {worst:.1e}; {TOLERANCE}).", {"launched": True, "seconds_run": round(run.seconds, 1)})


# ---------------------------------------------------------------------------------------------------------
# Exercise 3: a DistributedSampler by hand (checked in this process: no processes needed)

EX3_SIZES = (16, 11, 13, 10, 3)
EX3_WORLDS = (2, 3, 4, 1)
EX3_CALL_LIMIT_S = 10


def _check_sampler(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    from torch.utils.data import DistributedSampler

    text = path.read_text()
    if re.search(r"\bDistributedSampler\b", text.split('"""', 2)[-1]):
        _fail("uses-torch", "the script uses torch's DistributedSampler: write the logic yourself (the check "
              "compares against it, so using it proves nothing).")
    namespace = _guarded(path, lambda: runpy.run_path(str(path)), "loading the script")
    cls = namespace.get("ShardSampler")
    if cls is None:
        _fail("no-class", "the script defines no class ShardSampler.")

    def indices(s):
        return list(islice(iter(s), 10_000))

    cases = [(n, w, dl, seed) for n in EX3_SIZES for w in EX3_WORLDS for dl in (False, True) for seed in (0, 7)]
    checked = 0
    for shuffle in (True, False):
        for n, w, drop_last, seed in cases:
            dataset = list(range(n))
            where = f"n={n}, {w} rank(s), drop_last={drop_last}, shuffle={shuffle}, seed={seed}"
            def make(r, n=n, w=w, shuffle=shuffle, seed=seed, drop_last=drop_last):
                return cls(list(range(n)), num_replicas=w, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)

            mine = [_guarded(path, lambda r=r: make(r), "ShardSampler(...)") for r in range(w)]
            theirs = [DistributedSampler(dataset, num_replicas=w, rank=r, shuffle=shuffle, seed=seed,
                                         drop_last=drop_last) for r in range(w)]
            by_epoch = []
            for epoch in (0, 1, 2):
                for s, t in zip(mine, theirs):
                    _guarded(path, lambda s=s, e=epoch: s.set_epoch(e), "set_epoch()")
                    t.set_epoch(epoch)
                got = [_guarded(path, lambda s=s: indices(s), "iterating") for s in mine]
                want = [list(t) for t in theirs]
                by_epoch.append(got)
                for r, (s, g, t, wnt) in enumerate(zip(mine, got, theirs, want)):
                    length = _guarded(path, lambda s=s: len(s), "len()")
                    if length != len(t):
                        _fail("length", f"{where}: len() of rank {r}'s sampler is {length}, DistributedSampler's is "
                              f"{len(t)}.")
                    if len(g) != len(wnt):
                        _fail("count", f"{where}, epoch {epoch}: rank {r} yields {len(g)} indices, it should yield "
                              f"{len(wnt)} (= len()); ranks yield {[len(x) for x in got]}.")
                    if any(not isinstance(i, int) or not 0 <= i < n for i in g):
                        bad = next(i for i in g if not isinstance(i, int) or not 0 <= i < n)
                        _fail("bad-index", f"{where}: rank {r} yields {bad!r}, not an index 0..{n - 1} (an int).")
                again = [_guarded(path, lambda s=s: indices(s), "iterating") for s in mine]
                if again != got:
                    _fail("not-repeatable", f"{where}, epoch {epoch}: iterating twice in the same epoch gives two "
                          "different orders: the shuffle does not come from the seed and the epoch alone.")
                flat = [i for g in got for i in g]
                if n % w == 0 and len(flat) == n and len(set(flat)) < n:
                    dup = next(i for i in flat if flat.count(i) > 1)
                    owners = [r for r, g in enumerate(got) if dup in g]
                    _fail("overlap", f"{where}, epoch {epoch}: the shards overlap — index {dup} is given to "
                          + (f"ranks {owners[0]} and {owners[1]}" if len(owners) > 1 else f"rank {owners[0]} twice")
                          + f", while {sorted(set(range(n)) - set(flat))[:3]} go to nobody.")
            if shuffle and n > 3 and by_epoch[0] == by_epoch[1]:
                _fail("same-every-epoch", f"{where}: epochs 0 and 1 give every rank the same indices in the "
                      f"same order (rank 0: {by_epoch[0][0][:6]}...), although set_epoch was called.")
            for epoch, got in enumerate(by_epoch):
                for r, t in enumerate(theirs):
                    t.set_epoch(epoch)
                    want = list(t)
                    if got[r] != want:
                        same_set = sorted(got[r]) == sorted(want)
                        _fail("order" if same_set else "indices",
                              f"{where}, epoch {epoch}: rank {r} yields {got[r][:8]}{'...' if len(got[r]) > 8 else ''},"
                              f" DistributedSampler yields {want[:8]}{'...' if len(want) > 8 else ''}"
                              + (" — the same indices in another order." if same_set else "."))
            checked += 1
    return Verdict("pass", "pass", f"{checked} cases (dataset sizes {', '.join(map(str, EX3_SIZES))}; "
                   f"{', '.join(map(str, EX3_WORLDS))} ranks; drop_last and shuffle on and off; seeds 0 and 7; "
                   "epochs 0-2, every rank): the same indices as DistributedSampler, in the same order.")


def _guarded(path: Path, fn, what: str):
    """Run learner code in this process: an exception becomes an error verdict naming its line;
    a call that does not return within EX3_CALL_LIMIT_S is interrupted (main thread, Unix)."""
    use_alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} did not return within {EX3_CALL_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, on_alarm) if use_alarm else None
    if use_alarm:
        signal.setitimer(signal.ITIMER_REAL, EX3_CALL_LIMIT_S)
    try:
        return fn()
    except _Stop:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's code: any exception is a finding, not our failure
        import traceback

        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)]
        where = f" at {path.name} line {frames[-1].lineno}: `{frames[-1].line}`" if frames else ""
        diagnosis = "hang" if isinstance(error, TimeoutError) else "crash"
        _fail(diagnosis, f"{what} raised {type(error).__name__}{where}: {_short(str(error))}", status="error")
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------------------
# Exercise 4: overlap communication with backward (hooks, buckets, asynchronous all_reduce)

EX4 = {"steps": 8, "batch": 32, "lr": 0.05, "seed": 0, "cap": 4500}


def _ex4_reference(world: int = 1) -> Trajectory:
    data = regression_data(EX4["steps"] * EX4["batch"], seed=EX4["seed"])
    return _simulate(lambda: mlp(8, 64, 64, 64, 64, 1), data, nn.functional.mse_loss, world=world,
                     per_rank=EX4["batch"] // world, steps=EX4["steps"], lr=EX4["lr"], seed=EX4["seed"],
                     sampler="fixed")


def _ex4_bucket_count(cap: int) -> int:
    """How many buckets the stub's make_buckets builds for exercise 4's model (the same rule, computed here)."""
    count, size = 0, 0
    for p in reversed(list(mlp(8, 64, 64, 64, 64, 1).parameters())):
        if size and size + p.numel() > cap:
            count, size = count + 1, 0
        size += p.numel()
    return count + (size > 0)


def _per_step(rec: dict, op: str = "all_reduce") -> list[list[dict]]:
    """The rank's collectives of kind ``op``, grouped by the optimizer step they preceded."""
    steps, calls = rec["steps"], [c for c in rec["collectives"] if c["op"] == op]
    grouped, prev = [], float("-inf")
    for t in steps:
        grouped.append([c for c in calls if prev < c["t"] <= t])
        prev = t
    return grouped


def _check_overlap(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    run = _launch(path, ["--steps", EX4["steps"], "--batch-size", EX4["batch"], "--bucket-cap", EX4["cap"],
                         "--lr", EX4["lr"], "--seed", EX4["seed"]], work, backend, timeout)
    _failure(run, path, timeout)
    verdict = _compare_traces(run, _ex4_reference(), "every step", loss_ref=_ex4_reference(NPROC))
    trace = _load_trace(run, 0)
    buckets, n_params = _ex4_bucket_count(EX4["cap"]), len(trace["names"])
    started = during = asynchronous = 0
    into, lead = [], []  # per step: how far into backward() the first bucket started, and how long before its end
    for rank, rec in sorted(run.records.items()):
        per_step = _per_step(rec)
        counts = [len(calls) for calls in per_step]
        if any(c != buckets for c in counts):
            symptom = (f"the result is right, but rank {rank} called all_reduce {counts} times in its "
                       f"{len(counts)} steps; there are {buckets} buckets")
            if all(c == n_params for c in counts):
                _fail("per-parameter", symptom + f": one collective per parameter ({n_params}), not per bucket.",
                      launched=True)
            _fail("collective-count", symptom + ".", launched=True)
        for calls, (b_start, b_end) in zip(per_step, rec["backward"]):
            started += len(calls)
            during += sum(b_start <= c["t"] <= b_end for c in calls)
            asynchronous += sum(c["async"] for c in calls)
            if calls and b_end > b_start:
                into.append((calls[0]["t"] - b_start) / (b_end - b_start))
                lead.append(b_end - calls[0]["t"])
    into.sort()
    lead.sort()
    overlap = (f"{during} of {started} bucket all-reduces (both ranks, all steps) started before backward() returned, "
               f"{asynchronous} of them asynchronous" + ("" if during else ": none overlapped the backward pass"))
    if during and into:
        overlap += (f"; in the median step the first bucket started {into[len(into) // 2]:.0%} of the way into "
                    f"backward(), {lead[len(lead) // 2] * 1e3:.1f} ms before it returned")
    return Verdict("pass", "pass", f"{verdict.symptom[:-1]}; {buckets} all_reduce calls per step = {buckets} buckets, "
                   f"on every rank. Measured, not required: {overlap}.", {**verdict.facts, "overlapped": during,
                                                                           "collectives": started})


# ---------------------------------------------------------------------------------------------------------
# Exercise 5: ZeRO-1, the optimizer state sharded across the ranks

EX5 = {"steps": 8, "batch": 32, "lr": 0.01, "seed": 0}


def _ex5_build():
    return mlp(32, 32, 32, 32, 32)


def _ex5_reference(world: int = 1) -> Trajectory:
    data = regression_data(EX5["steps"] * EX5["batch"], dim_in=32, dim_out=32, seed=EX5["seed"])
    return _simulate(_ex5_build, data, nn.functional.mse_loss, world=world, per_rank=EX5["batch"] // world,
                     steps=EX5["steps"], lr=EX5["lr"], seed=EX5["seed"], sampler="fixed", optimizer="adam")


def _adam_state_bytes() -> int:
    """Bytes of Adam's state for the whole model, as one process holds it."""
    model = _ex5_build()
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())


def _check_zero(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    run = _launch(path, ["--steps", EX5["steps"], "--batch-size", EX5["batch"], "--lr", EX5["lr"],
                         "--seed", EX5["seed"]], work, backend, timeout)
    _failure(run, path, timeout)
    ref = _ex5_reference()
    try:
        verdict = _compare_traces(run, ref, "every step", loss_ref=_ex5_reference(NPROC))
    except _Stop as stop:
        v = stop.verdict
        if v.diagnosis in ("differs", "summed", "halved") and "step" in v.facts:
            k, trace = v.facts["step"], _load_trace(run, 0)
            still = [name for name, a, b in zip(trace["names"], trace["params"][k - 1], trace["params"][k])
                     if _close(a, b)]
            if still:
                v.diagnosis = "not-updated"
                v.symptom = (f"after step {k} both ranks agree, but {len(still)} of {len(trace['names'])} parameters "
                             f"did not change at all ({', '.join(still[:4])}{' ...' if len(still) > 4 else ''}).")
        raise
    full = _adam_state_bytes()
    held = {rank: rec["state_bytes"] for rank, rec in sorted(run.records.items())}
    shares = ", ".join(f"rank {r} {b:,} bytes ({b / full:.0%})" for r, b in held.items())
    if max(held.values()) > full * (1 / NPROC + 0.15):
        _fail("state-not-sharded", f"the parameters are right, but the optimizer state is not sharded: {shares} of "
              f"the {full:,} bytes one process holds for the whole model.", launched=True)
    if sum(held.values()) < full * 0.95:
        _fail("state-missing", f"the ranks together hold less optimizer state than the whole model needs: {shares} "
              f"of {full:,} bytes.", launched=True)
    return Verdict("pass", "pass", f"{verdict.symptom[:-1]}. Adam state per rank: {shares} of the {full:,} bytes "
                   "one process holds.", verdict.facts)


# ---------------------------------------------------------------------------------------------------------
# Exercise 6: the debugging lab (three broken DDP scripts; each check runs the fixed script)

EX6 = {"epochs": 2, "per_rank": 16, "lr": 0.05, "seed": 0}
EX6C = {"per_rank": 8, "accum": 4, "steps": 4, "lr": 0.05, "seed": 0}  # 4 steps x 2 ranks x 4 x 8 = 256 samples


def _ex6_reference(world: int = 1, **changes) -> Trajectory:
    train, val = lab_datasets()
    cfg = {**EX6, **changes}
    per_rank = cfg.pop("per_rank") * (NPROC if world == 1 else 1)
    return _simulate(lambda: mlp(8, 32, 1), train, nn.functional.mse_loss, world=world, per_rank=per_rank,
                     val=val, val_fn=_mse_val, momentum=0.9, **cfg)


def _check_hang(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    run = _launch(path, ["--epochs", EX6["epochs"], "--batch-size", EX6["per_rank"], "--lr", EX6["lr"]],
                  work, backend, timeout)
    _failure(run, path, timeout)
    metrics = _metrics(run)
    ref_sum, ref_total = _ex6_reference().val
    last = metrics["val"][-1]
    if len(metrics["val"]) != EX6["epochs"]:
        _fail("val-missing", f"metrics.json has {len(metrics['val'])} validation results, one per epoch "
              f"({EX6['epochs']}) expected.", launched=True)
    if last["count"] != ref_total:
        _fail("val-partial" if last["count"] < ref_total else "val-count",
              f"the job finishes, but validation counts {last['count']} samples of {ref_total}.", launched=True)
    if not _close(last["mse"], ref_sum / ref_total):
        _fail("val-differs", f"the job finishes, but the last validation MSE is {last['mse']:.6f}; one process on "
              f"the same global batches gets {ref_sum / ref_total:.6f}.", launched=True)
    return Verdict("pass", "pass", f"the job finishes in {run.seconds:.0f} s; validation after each of the "
                   f"{EX6['epochs']} epochs over all {ref_total} samples, final MSE {last['mse']:.5f} = the "
                   "single-process run's.", {"launched": True})


def _metrics(run: Run) -> dict:
    path = run.out / "metrics.json"
    if not path.exists():
        _fail("no-output", f"the job ended without writing {path.name}.", launched=True)
    return json.loads(path.read_text())


def _check_epochs(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    epochs = 3
    run = _launch(path, ["--epochs", epochs, "--batch-size", EX6["per_rank"], "--lr", EX6["lr"]], work, backend,
                  timeout)
    _failure(run, path, timeout)
    for rank, rec in sorted(run.records.items()):
        seen = [s for s in rec["samplers"] if len(s["indices"]) == len(lab_datasets()[0]) // NPROC]
        if len(seen) < epochs:
            _fail("sampler", f"rank {rank} iterated its training sampler {len(seen)} times for {epochs} epochs.",
                  launched=True)
        for e in range(1, epochs):
            if seen[e]["indices"] == seen[e - 1]["indices"]:
                _fail("same-order", f"the job runs, but epoch {e} gave rank {rank} exactly the same {len(seen[e]['indices'])} "
                      f"samples in the same order as epoch {e - 1} ({seen[e]['indices'][:5]}...; the check records "
                      "what each rank's DistributedSampler yields).", launched=True)
    ref = _ex6_reference(epochs=epochs)
    verdict = _compare_traces(run, ref, "a new order each epoch")
    verdict.symptom = (f"every epoch gives each rank a new order; after {epochs} epochs "
                       + verdict.symptom.split(": ", 1)[1])
    return verdict


def _ex6c_reference(accum=None, loss_scale=1.0) -> Trajectory:
    train, _ = lab_datasets()
    return _simulate(lambda: mlp(8, 32, 1), train, nn.functional.mse_loss, per_rank=EX6C["per_rank"] * NPROC,
                     accum=accum or EX6C["accum"], steps=EX6C["steps"], lr=EX6C["lr"], seed=EX6C["seed"],
                     loss_scale=loss_scale, epochs=1)


def _check_accumulation(path: Path, work: Path, backend: str, timeout: float) -> Verdict:
    run = _launch(path, ["--steps", EX6C["steps"], "--batch-size", EX6C["per_rank"], "--accum", EX6C["accum"],
                         "--lr", EX6C["lr"]], work, backend, timeout)
    _failure(run, path, timeout)
    ref = _ex6c_reference()
    try:
        verdict = _compare_traces(run, ref, f"{EX6C['accum']} micro-batches of {EX6C['per_rank']} per rank per step")
    except _Stop as stop:
        v = stop.verdict
        if v.diagnosis in ("differs", "summed") and abs(v.facts.get("ratio", 0) - EX6C["accum"]) < 0.05 * EX6C["accum"]:
            v.diagnosis = "accum-not-divided"
            v.symptom = (f"the job runs, but after step {v.facts['step']} the parameters moved {v.facts['ratio']:.2f}× "
                         f"as far as one process's step on the same {EX6C['per_rank'] * NPROC * EX6C['accum']} samples.")
        raise
    return verdict


# ---------------------------------------------------------------------------------------------------------
# Hints: per diagnosis, from the symptom to the tool to the cause. Never the answer at the first level.

COMMON_HINTS = {
    "missing": ["Run the `%%writefile` cell of the exercise (it writes the script), then this cell."],
    "syntax": [("Python cannot read the script: fix the line shown (the caret points where Python gave up), run "
                "the `%%writefile` cell again, then this cell."),
               "Look also at the line above the one shown: an unclosed bracket or quote is often reported one line late.",
               "Indentation counts: the filled-in lines must line up with the code around the gap."],
    "gaps": [("Replace each `...` marked `# TODO` with your code (the comment can stay), run the `%%writefile` cell, "
              "then this cell.")],
    "crash": ["Read the error and the line of your script it points to: which name or shape does it complain about?",
              ("Run the script by hand to see every rank's whole output: `torchrun --standalone --nproc-per-node=2 "
               "scripts/<name>.py`, or read output.txt in the run folder."),
              ("If the error is about a name that does not exist, compare your line with the imports at the top and "
               "the variables defined above it; for a shape or device error print the tensors' .shape and .device.")],
    "hang": [("One rank waited in a collective (all_reduce, broadcast, barrier, ...) that the other never called, or "
              "called in another order; the process-group timeout ended it. The lines above show where each rank was."),
             ("Every collective must be called by every rank, the same number of times, in the same order. Look for a "
              "collective inside an `if` on the rank, or in a loop whose length differs between ranks (notebook 04 "
              "shows both: section 12, a collective only some ranks call; section 7, uneven inputs)."),
             ("Find the collective in the rank that timed out, then the condition or loop that keeps the other rank "
              "from reaching it, and make every rank call it.")],
    "no-trace": [("Keep the lines that create `trace = Trace(...)`, call `trace.step(...)` and `trace.save()`: the "
                  "checker reads what they record.")],
    "steps": [("The number of optimizer steps differs from the reference: check the loop bounds and the batch size "
               "(per process, as the check passes it).")],
    "differs": ["Compare your step with the reference: which parameters differ first, and by how much?",
                ("Print, on each rank, a gradient's norm after your averaging and the same gradient's norm on one "
                 "process with the whole batch: they should be equal."),
                ("Check each line between backward() and optimizer.step(): the gradient every rank applies must be the "
                 "mean over ranks of their gradients.")],
    "loss-differs": ["The parameters are right but the recorded losses are not: record the loss of the step you took."],
    "log-unreadable": [("The log file holds broken lines: two processes wrote into it at once. Which ranks open it for "
                        "writing?"),
                       "Only one process (rank 0) should open and write the log; the others should not touch it."],
}

EX1_HINTS = {
    "no-output": ["The script must still write log.jsonl and model.pt into --out (one process writes them)."],
    "every-rank-writes": ["Two processes writing one file overwrite each other (and can leave a torn file).",
                          "Which variable tells a process whether it is the first one? Use it to choose who writes.",
                          ("Put the writing (log and checkpoint) under `if rank == 0:` — every rank still computes what "
                           "it writes, only one writes it.")],
    "no-sharding": [("With N processes each step sees N per-process batches: the processes must split the data, "
                     "not each read all of it."),
                    "Which sampler gives each process its own part of the data set? (Notebook 03, step 4.)",
                    ("Replace the RandomSampler by a DistributedSampler(train_set, seed=args.seed); its order is the "
                     "single-device script's order, split between the ranks.")],
    "steps": ["Count the steps: an epoch of 512 samples with 2 processes × 16 per step is 16 steps."],
    "local-loss": ["Each rank's loss is the loss of its own part of the global batch.",
                   ("To log the loss of the whole global batch, every rank must contribute its loss: which collective "
                    "combines one number from every rank?"),
                   "all_reduce a copy of the loss (detached) and divide by the world size before logging it."],
    "no-set-epoch": ["Epoch 0 matches; epoch 1 does not: the order of epoch 1 is not the single-device run's.",
                     ("The single-device script reseeds its order every epoch (seed + epoch). What does "
                      "DistributedSampler need to know to do the same?"),
                     "Call sampler.set_epoch(epoch) at the start of every epoch."],
    "not-averaged": ["Each rank trained on its own: the gradients were never averaged between the ranks.",
                     "What makes the ranks average their gradients in backward()? (Notebook 03, step 3.)",
                     "Wrap the model in DistributedDataParallel after moving it to the device."],
    "loss-differs": ["Compare your step loop with the single-device one, line by line: what else changed?",
                     "Run both scripts and print the first 3 losses of each.",
                     ("The global batch of step k must be the single-device batch of step k: same sampler seed, "
                      "per-process batch 16 (the check passes --batch-size 16).")],
    "module-prefix": ["A DDP-wrapped model's state_dict has every key prefixed with `module.`.",
                      "Save the state_dict of the model inside the wrapper, not of the wrapper.",
                      "Save model.module.state_dict()."],
    "params-differ": ["The logged losses match but the saved parameters do not: are you saving the model after training?"],
    "val-padded": ["301 samples cannot be split evenly between 2 ranks. What does DistributedSampler do then?",
                   "DistributedSampler pads by repeating samples: fine for training, wrong for counting.",
                   ("Give each rank every world_size-th validation sample without padding: "
                    "Subset(val_set, range(rank, len(val_set), world_size)).")],
    "val-twice": ["Every rank evaluated the whole validation set, and the counts were summed.",
                  "Split the validation set between the ranks too.",
                  "Subset(val_set, range(rank, len(val_set), world_size)) gives each rank its own part."],
    "val-partial": ["The count covers only part of the validation set.",
                    "Each rank counted its own part; which collective adds them up?",
                    "all_reduce the [correct, total] tensor before reading it."],
    "val-count": ["The validation counts do not add up to the set: each sample must be counted exactly once."],
    "val-missing": [("End the log with exactly one {'val_correct': ..., 'val_total': ...} record, as the "
                     "single-device script does.")],
}

EX2_HINTS = {
    "no-broadcast": ["Each rank seeded its own random initial weights, and nothing made them equal.",
                     "Which collective copies one rank's tensor to every other rank? (See the glossary: broadcast.)",
                     ("In start_from_the_same_weights, broadcast every parameter from rank 0; it works in place on "
                      "p.data.")],
    "wrong-start": ["The ranks agree, but on the wrong weights: which rank's weights did you copy?",
                    "The reference starts from rank 0's weights.",
                    "Broadcast with src=0."],
    "summed": ["The factor is the world size: the gradients were added up over the ranks, not averaged.",
               "What does dist.all_reduce compute by default? (Look at its `op` argument.)",
               "After the all_reduce (a sum), divide each gradient by the world size."],
    "halved": ["The step is 1/world size of the reference's: the average was divided once too often.",
               "Count the divisions by the world size between backward() and optimizer.step().",
               "Sum with all_reduce, then divide once."],
    "ranks-differ": [("Some parameters were updated with a different gradient on each rank: not every gradient was "
                      "averaged."),
                     ("Print, on each rank, the norm of every parameter's gradient after average_gradients: they must "
                      "be equal on both ranks."),
                     "Loop over every parameter of the model (model.parameters()) and all_reduce each p.grad."],
    "hang": [("A collective was called by one rank only: the other never joined it, and the process-group timeout "
              "ended the job. The lines above show where each rank was."),
             ("Every rank must call the same collectives in the same order. Is one of your calls inside an `if` on the "
              "rank? (Notebook 04, section 12.)"),
             "Call all_reduce on every rank for every gradient: no condition on the rank around it."],
}

EX3_HINTS = {
    "length": ["len() must say how many indices each rank yields: the same number on every rank.",
               "Without drop_last, round up (pad); with drop_last, round down (cut). Try n=11 with 3 ranks on paper.",
               "num_samples = ceil(n / num_replicas) without drop_last, floor(n / num_replicas) with it."],
    "count": ["Every rank must yield exactly len() indices, even when the data set does not split evenly.",
              "How many indices do you need in all before splitting? num_samples × num_replicas.",
              ("Without drop_last, append indices from the start of the list until it is long enough (repeat it when "
               "it is shorter than the padding); with drop_last, cut the list to that length.")],
    "bad-index": ["Yield plain int indices between 0 and n-1 (call .tolist() on a tensor)."],
    "overlap": ["Two ranks got the same index while others went to nobody: the shards overlap.",
                ("Print each rank's list for n=8 and 2 ranks: together they must be a permutation of range(8). Does "
                 "every rank compute the same permutation?"),
                ("Every rank must shuffle with the same generator seed (seed + epoch, never the rank), then take "
                 "indices[rank::num_replicas].")],
    "not-repeatable": [("The order must depend only on seed and epoch (every rank computes it on its own and they "
                        "must agree)."),
                       ("Does your shuffle use the global random generator (torch.randperm without generator=, "
                        "random.shuffle)?"),
                       "Create a torch.Generator, manual_seed(self.seed + self.epoch), and pass it to torch.randperm."],
    "same-every-epoch": ["set_epoch was called, but the order did not change.",
                         "What does set_epoch store, and does __iter__ use it?",
                         "Seed the generator with self.seed + self.epoch."],
    "order": ["Your shard holds the right indices in another order.",
              ("DistributedSampler shuffles with torch.randperm(n, generator=g), g seeded with seed + epoch; "
               "then it takes every num_replicas-th index."),
              ("Use exactly: g = torch.Generator(); g.manual_seed(self.seed + self.epoch); "
               "torch.randperm(self.n, generator=g).tolist(); then indices[self.rank::self.num_replicas].")],
    "indices": ["Your shard holds other indices than DistributedSampler's.",
                ("Which positions of the padded list does rank r take? DistributedSampler takes every "
                 "num_replicas-th, starting at r (not a contiguous block); padding repeats the list from its start."),
                "indices += indices[:padding] (repeat if needed), then indices[self.rank::self.num_replicas]."],
    "uses-torch": ["Write the sampler yourself, from torch.randperm and list slicing."],
    "no-class": ["Keep the class name ShardSampler: the check looks for it."],
}

EX4_HINTS = {
    "summed": ["The step is world-size times too large: the buckets were summed over the ranks, not averaged.",
               "all_reduce sums; where do you divide?",
               "Divide each bucket's flat tensor by the world size after wait(), before copying it back."],
    "ranks-differ": [("The ranks applied different gradients: some averages did not arrive, or arrived after "
                      "they were used."),
                     ("An asynchronous all_reduce returns at once; its result is in the tensor only after the "
                      "handle's wait(). And the result is in the *flat* tensor, not in the .grad tensors."),
                     ("In finish(): for each pending (handle, flat, i): handle.wait(), divide flat by the world size, "
                      "then copy each parameter's slice of flat back into its .grad (view_as).")],
    "differs": [("The ranks agree with each other but not with the reference: the averaged gradients were not "
                 "written back correctly."),
                ("Check the slicing: the offsets into the flat tensor must follow the bucket's parameter order, "
                 "the same order used by torch.cat."),
                "Copy flat[offset:offset + q.numel()].view_as(q.grad) into q.grad, then advance offset by q.numel()."],
    "per-parameter": [("Every parameter got its own collective: correct, but the point of buckets is fewer, larger "
                       "messages."),
                      "Start a collective only when the *last* gradient of a bucket is ready (count them).",
                      ("In on_grad_ready: when ready[i] == len(buckets[i]), torch.cat the bucket's gradients and "
                       "all_reduce that one tensor.")],
    "collective-count": [("The number of all_reduce calls per step differs from the number of buckets (see the counts "
                          "above)."),
                         ("If the counts are right in step 0 and wrong later: are the ready-counters reset after each "
                          "step? If some buckets are never reduced: does every parameter have a hook?"),
                         "Register the hook on every parameter; reset ready and pending in finish()."],
    "hang": COMMON_HINTS["hang"],
}

EX5_HINTS = {
    "ranks-differ": [("After the step the ranks hold different values: each rank updated only its own parameters, "
                      "and the others never learned the new values."),
                     "Which collective sends one rank's tensor to all the others, and which rank must send it?",
                     "After optimizer.step(), broadcast every parameter from its owner: src=owner[p]."],
    "not-updated": [("Some parameters never change: their owner's update did not reach the ranks (or was overwritten "
                     "by an old copy)."),
                    "Who has the new value of a parameter after optimizer.step()? Only its owner.",
                    "Broadcast each parameter with src=owner[p], not from a fixed rank."],
    "state-not-sharded": [("Every rank keeps Adam's state for the whole model: the results are right, the memory is "
                           "not saved."),
                          "Adam creates state for the parameters you pass it. Which ones should this rank pass?",
                          "Build Adam over `mine`, the parameters this rank owns."],
    "state-missing": ["Some parameters have no owner's optimizer: every parameter must be in exactly one rank's Adam."],
}

EX6A_HINTS = {
    "hang": [("The job hangs: one rank waits in a collective, the other waits somewhere else. The lines above show "
              "where each rank was when the timeout ended it."),
             ("Two ranks waiting in two *different* collectives is the signature of a collective that only some ranks "
              "call. Follow the waiting rank's line up to the code that called it: is that code run by every rank? "
              "(Notebook 04, section 12; `py-spy dump --pid PID` shows the same for a live job.)"),
             ("evaluate() contains an all_reduce, and only rank 0 calls evaluate(). Every rank must evaluate its own "
              "part; only the printing and saving belong to rank 0.")],
    "val-partial": ["The job finishes now, but the validation counts only part of the set.",
                    "Each rank evaluates its own part: the parts must be added up on every rank.",
                    "Call evaluate() (with its all_reduce) on every rank; print on rank 0."],
    "val-differs": ["The job finishes, but the validation number is not the single-process one.",
                    "Evaluate after the same training on every rank, with each rank's own part summed."],
    "no-output": ["Rank 0 must still write metrics.json (the check reads the validation results from it)."],
}

EX6B_HINTS = {
    "sampler": ["Keep the training loop reading its DistributedSampler once per epoch: the check records what it yields."],
    "same-order": [("Every epoch shows each rank exactly the same samples in the same order: the model sees one "
                    "fixed order over and over."),
                   ("Print the first indices of each rank's sampler in every epoch (list(sampler)[:5], notebook 04 "
                    "section 2). When does the sampler's epoch change?"),
                   ("DistributedSampler shuffles with seed + epoch; its epoch is what you last passed to set_epoch. "
                    "Look at *where* set_epoch is called, relative to the loop that reads the data.")],
    "differs": [("The order changes now, but the run is not the reference's: each epoch e must use the order of "
                 "DistributedSampler's epoch e."),
                "Call sampler.set_epoch(epoch) before the loop over the data of that epoch."],
}

EX6C_HINTS = {
    "accum-not-divided": [("The factor is also the number of accumulation steps (--accum 4): something adds up once "
                           "per micro-batch."),
                          ("backward() adds to .grad. Compare the gradient after 4 micro-batches with the gradient "
                           "of one batch of the same 4× size (notebook 04 section 13 compares steps like this)."),
                          ("Each micro-batch's loss is a mean over its samples; the 4 backward() calls add 4 means. "
                           "Divide each micro-batch's loss by the number of accumulation steps before backward().")],
}


EXERCISES: dict[str, Exercise] = {
    "1": Exercise("1", "Convert a script to DDP", "ex1_convert.py", _check_convert, EX1_HINTS),
    "2": Exercise("2", "DDP by hand", "ex2_by_hand.py", _check_by_hand, EX2_HINTS),
    "3": Exercise("3", "A DistributedSampler by hand", "ex3_sampler.py", _check_sampler, EX3_HINTS, launches=False),
    "4": Exercise("4", "Overlap: buckets and hooks", "ex4_overlap.py", _check_overlap, EX4_HINTS),
    "5": Exercise("5", "ZeRO-1: shard the optimizer state", "ex5_zero1.py", _check_zero, EX5_HINTS),
    "6a": Exercise("6a", "Debugging lab: a hang", "ex6a_debug.py", _check_hang, EX6A_HINTS),
    "6b": Exercise("6b", "Debugging lab: the same every epoch", "ex6b_debug.py", _check_epochs, EX6B_HINTS),
    "6c": Exercise("6c", "Debugging lab: a step too large", "ex6c_debug.py", _check_accumulation, EX6C_HINTS),
}
