"""Reading and running a learner's script: what is reported without running anything (a missing file, a syntax
error, gaps still marked ``...  # TODO``), launching it on ``NPROC`` processes (forked ranks on Linux:
``course.exercises.forked``; else torchrun) under the recorder
(``ddp_doctor/recorder/recorder.py``: the files each rank writes, its collectives, its samplers), turning a crash or a hang
into a verdict that names the rank and the line of the learner's script, and calling learner code in this
process under a time limit (exercises checked without processes).
"""

import ast
import io
import json
import re
import shutil
import signal
import threading
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import torch

from course import ROOT
from course.exercises import forked
from course.exercises.crashes import reading as crash_reading
from course.exercises.reference import NPROC
from course.exercises.results import Stop, Verdict, fail, rel
from ddp_doctor.recorder import ENTRY as RECORDER
from ddp_doctor.runner.plan import plan
from ddp_doctor.runner.stacks import one_line
from ddp_doctor.runner.torchrun_output import EXIT_RACE_NOTE, aborted_at_exit, first_failure, rank_lines

PG_TIMEOUT_S = 10  # process-group timeout passed to the scripts: a rank waiting for a partner gives up after it
LAUNCH_TIMEOUT_S = 90  # wall-clock limit of a whole launch (a loop that never ends); check(timeout=) changes it
CALL_LIMIT_S = 10  # a call into learner code made in this process
SIZES = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match expected size")  # gloo: sent vs buffer
P2P = re.compile(r"\b(dist\.)?(i?send|i?recv|batch_isend_irecv|P2POp)\(")  # a point-to-point line of the script
HANG_MESSAGES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                 "doesn't match expected size", "collective mismatch", "Socket Timeout")


def gaps(text: str) -> list[tuple[int, str]]:
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


def static_check(path: Path) -> Verdict | None:
    """A missing file, a syntax error or gaps left: reported without running anything."""
    if not path.exists():
        return Verdict("not solved", "missing", f"{rel(path)} does not exist: run the %%writefile cell above first.")
    text = path.read_text()
    try:
        ast.parse(text, filename=str(path))
    except SyntaxError as error:
        line = (error.text or "").rstrip("\n")
        caret = " " * (max(error.offset or 1, 1) - 1 + 4) + "^"
        return Verdict("error", "syntax", f"SyntaxError in {path.name}, line {error.lineno}: {error.msg}\n"
                                          f"    {line.strip()}\n{caret if line == line.lstrip() else ''}".rstrip())
    left = gaps(text)
    if left:
        listed = "".join(f"\n    line {i:>3}  {todo}" for i, todo in left)
        return Verdict("not solved", "gaps", f"{len(left)} gap{'s' if len(left) > 1 else ''} still marked "
                                               f"`...  # TODO`:{listed}")
    return None


@dataclass
class Run:
    returncode: int | None  # None: stopped at the wall-clock limit
    output: str
    records: dict  # rank -> what ddp_doctor/recorder/recorder.py recorded
    out: Path
    seconds: float
    places: str = ""  # where each rank was at a timeout (ddp_doctor.runner.stacks), one line
    order: list | None = None  # forked ranks: the ranks that failed, first to fail first (torchrun: its report)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def launch(path: Path, args, work: Path, backend: str, timeout: float, fork: bool | None = None) -> Run:
    """Run the script on NPROC processes under the recorder, writing into ``work`` (emptied first): CPU ranks forked
    from a process that imported torch once (``course.exercises.forked``; ``fork``: None where usable, on Linux), else
    started by torchrun (a GPU's ranks too: nothing of CUDA is inherited through a fork)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    start = time.monotonic()
    argv = [path.resolve(), *map(str, args), "--out", work, "--timeout", PG_TIMEOUT_S]
    chosen = plan(NPROC, backend, allow_oversubscribe=True)  # 1 core: slow, still right
    order = None
    if forked.usable() and chosen.device == "cpu" if fork is None else fork:  # CPU ranks: nothing to re-initialise
        ended = forked.run([RECORDER, *argv], NPROC, {**chosen.env(), "COURSE_RECORD_OUT": str(work)}, ROOT, timeout)
        code, output, places, order = ended.returncode, ended.output, ended.places, ended.order
    else:
        code, output, places = _torchrun(argv, work, backend, timeout)
    (work / "output.txt").write_text(output)
    records = {}
    for f in work.glob("record_rank*.json"):
        try:
            records[int(f.stem.removeprefix("record_rank"))] = json.loads(f.read_text())
        except ValueError:
            pass
    return Run(code, output, records, work, time.monotonic() - start, one_line(places), order)


def _torchrun(argv: list, work: Path, backend: str, timeout: float) -> tuple:
    from course.launcher import LaunchError
    from course.launcher import launch as torchrun

    lines: list[str] = []
    try:
        result = torchrun(RECORDER, NPROC, argv, backend=backend, env={"COURSE_RECORD_OUT": str(work)},
                          timeout=timeout, check=False, quiet=True, on_line=lines.append, allow_oversubscribe=True)
        code, output, places = result.returncode, result.output, result.places
    except LaunchError as error:  # stopped at the wall-clock limit
        code, output, places = None, getattr(error, "output", None), error.places
    return code, output or "".join(lines), places  # the whole output: the streamed lines fold repeats across ranks


@dataclass
class Crash:
    rank: int
    error: str  # the exception line, shortened
    frames: list[tuple[int, str, str]]  # (line number, function, code) in the learner's script


def _crashes(output: str, path: Path) -> list[Crash]:
    """Per rank, the last Python traceback in its output: the error and the frames in the learner's script."""
    found = []
    name = str(path.resolve())
    for rank, lines in sorted(rank_lines(output).items()):
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
                after = block[i + 1] if i + 1 < len(block) else ""  # a message that goes on, indented
                error = line.strip() + (" " + after.strip() if after.startswith(" ") and after.strip()
                                        and not after.lstrip().startswith("File ") else "")
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


def waiting(error: str) -> bool:
    """Whether a rank's error only says that it gave up on its partner (a timeout, a closed connection)."""
    return any(m in error for m in HANG_MESSAGES)


def failure(run: Run, path: Path, timeout: float) -> None:
    """Turn a failed or stopped run into a verdict: a crash (a rank raised an error of its own: it is the cause,
    even if its partner then reports the closed connection) or a hang (every error is a rank giving up on a
    partner). The symptom says what happened; where each rank was goes to ``facts["detail"]`` too (the
    debugging lab shows it only on request) and every rank's error to ``facts["errors"]``."""
    if run.ok:
        return
    crashes = _crashes(run.output, path)
    errors = {c.rank: c.error for c in crashes}
    if run.returncode is None and not crashes:
        fail("hang", f"the job was still running after {timeout:.0f} s and was stopped (every process ended): "
                      "a loop that never ends, or a rank waiting for a partner." + (f" {run.places}" if run.places else ""),
             status="error", launched=True, detail=run.places, errors=errors)
    own = [c for c in crashes if c.error and not waiting(c.error)]
    sizes = next(((c, m) for c in crashes if (m := SIZES.search(c.error))), None)
    if sizes and any(P2P.search(c.frames[-1][2]) for c in crashes if c.frames):  # a send and its receive disagree
        rx, m = sizes
        fail("crash-shape", f"rank {rx.rank} was sent {m[1]} bytes into a receive buffer of {m[2]} bytes (gloo: "
                            f"\"Received data size doesn't match expected size\"): the buffer passed to dist.recv "
                            "has another shape than the tensor its partner sent. " + "; ".join(
                                f"rank {c.rank} at {_where(c, path) or 'a line outside your script'}" for c in crashes)
             + ".", status="error", launched=True, detail="", errors=errors, rank=rx.rank)
    if crashes and not own:
        waited = [c for c in crashes if "Timed out" in c.error]
        detail = "; ".join(f"rank {c.rank} {'waited' if c in waited else 'failed'} at "
                           f"{_where(c, path) or 'a line outside your script'}" + ("" if c in waited else f" ({c.error})")
                           for c in crashes) + "." + (f" {run.places}" if run.places else "")
        lead = (f"the job hung: a rank waited in a collective that the other never joined, until the {PG_TIMEOUT_S} s "
                "process-group timeout" if waited else "a collective of one rank was not matched by the other")
        fail("hang", f"{lead}. {detail}", status="error", launched=True, crashes=len(crashes), lead=lead + ".",
             detail=detail, errors=errors)
    if own:
        root = first_failure(run.output)  # torchrun's report: the rank that failed first
        first = next((c for r in (run.order or []) for c in own if c.rank == r), None) or \
            next((c for c in own if root and c.rank == root["rank"]), own[0])
        where = _where(first, path)
        at_exit = " " + EXIT_RACE_NOTE if aborted_at_exit(rank_lines(run.output).get(first.rank, [])) else ""
        fail("crash", f"rank {first.rank} crashed" + (f" at {where}" if where else "") + f": {first.error}{at_exit}",
             status="error", launched=True, detail=where, errors=errors, rank=first.rank,
             reading=crash_reading(run.records.get(first.rank), first.frames[-1] if first.frames else None))
    tail = " | ".join(run.output.strip().splitlines()[-3:])
    fail("crash", f"the job failed with exit code {run.returncode}: {_short(tail)}", status="error", launched=True,
         detail="", errors=errors)


def load_trace(run: Run, rank: int) -> dict:
    path = run.out / f"trace_rank{rank}.pt"
    if not path.exists():
        fail("no-trace", f"rank {rank} wrote no {path.name}: the script must keep its `trace.save()` at the end.",
              launched=True)
    return torch.load(path, weights_only=True)


def load_traces(run: Run) -> list[dict]:
    """Every rank's recorded trace (course.exercise_tasks.Trace), rank 0 first."""
    return [load_trace(run, r) for r in range(NPROC)]


def guarded(path: Path, fn, what: str):
    """Run learner code in this process: an exception becomes an error verdict naming its line;
    a call that does not return within CALL_LIMIT_S is interrupted (main thread, Unix)."""
    use_alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} did not return within {CALL_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, on_alarm) if use_alarm else None
    if use_alarm:
        signal.setitimer(signal.ITIMER_REAL, CALL_LIMIT_S)
    try:
        return fn()
    except Stop:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's code: any exception is a finding, not our failure
        import traceback

        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)]
        where = f" at {path.name} line {frames[-1].lineno}: `{frames[-1].line}`" if frames else ""
        diagnosis = "hang" if isinstance(error, TimeoutError) else "crash"
        fail(diagnosis, f"{what} raised {type(error).__name__}{where}: {_short(str(error))}", status="error",
             errors={0: f"{type(error).__name__}: {_short(str(error))}"}, rank=0)
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def load_metrics(run: Run) -> dict:
    """The metrics.json a run wrote into its --out folder."""
    path = run.out / "metrics.json"
    if not path.exists():
        fail("no-output", f"the job ended without writing {path.name}.", launched=True)
    return json.loads(path.read_text())


def per_step(rec: dict, op: str = "all_reduce") -> list[list[dict]]:
    """A rank's recorded collectives of kind ``op``, grouped by the optimizer step they preceded."""
    steps, calls = rec["steps"], [c for c in rec["collectives"] if c["op"] == op]
    grouped, prev = [], float("-inf")
    for t in steps:
        grouped.append([c for c in calls if prev < c["t"] <= t])
        prev = t
    return grouped
