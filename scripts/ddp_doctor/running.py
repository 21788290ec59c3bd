"""Running a learner's script for the doctor: N processes under the recorder (``ddp_doctor/recorder/recorder.py``), on one node
or as simulated nodes, bounded by a timeout; a hang is stopped only after every rank has said where it was. After
the run the learner's folders are as they were: files the script overwrote or deleted are restored, files it
created are moved into the doctor's folder (``files``).

How it runs is read from the script first (``style``), and the run proves it:
- a script that starts its own processes (``mp.spawn``, ``start_processes``, ``multiprocessing.Process``) runs
  once, as its author runs it (``python script.py``), with the recorder in every process it starts, and its own
  rendezvous port replaced by a free one (never two worlds at once, never a port another job holds);
- a script that takes ``--local_rank``/``--local-rank`` gets it, as ``torch.distributed.launch`` gave it;
- a script written for CUDA or NCCL runs with the CPU stand-in (``recorder_standin.py``) when the machine has
  fewer accelerators than the doctor's ranks; one that never asks ``torch.cuda.is_available()`` is told that
  CUDA is there, so that it takes the path its author wrote.
A rank that fails ends the job within seconds, as under torchrun (the others first say where they are).
"""

import io
import json
import os
import re
import shutil
import sys
import threading
import time
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from ddp_doctor.recorder import ENTRY as RECORDER


@dataclass
class Job:
    script: Path
    args: list
    nproc: int = 2
    nodes: int = 1
    cwd: Path = field(default_factory=Path.cwd)
    timeout: float = 180.0  # wall-clock limit of the whole job
    hang_after: float = 30.0  # the process-group timeout the script gets instead of its own
    steps: int = 8  # training batches per pass over a DataLoader (0: the whole pass)
    launch: str = "torchrun"  # or "spawn": the script starts its own processes
    standin: bool = False  # the CPU stand-in for CUDA and NCCL
    pretend: bool = False  # the stand-in says CUDA is there (the script has no CPU path)
    local_rank_arg: str = ""  # "--local_rank" or "--local-rank": given to the script
    launch_why: str = ""  # why this launch style: the user's --launch, or the first try's failure


@dataclass
class Run:
    job: Job
    returncode: int | None  # None: stopped at the timeout
    output: str
    records: dict  # rank -> what the recorder wrote
    stuck: dict  # rank -> where it was when the job was stopped
    seconds: float
    failure: str = ""  # the launcher's short text naming the first failing rank
    moved: list = field(default_factory=list)  # files the run created, now in the doctor's folder
    restored: list = field(default_factory=list)  # files the run overwrote or deleted, restored
    lost: list = field(default_factory=list)  # files the run overwrote or deleted that could not be restored
    parent: dict = field(default_factory=dict)  # a script that starts its own processes: its own record
    later: list = field(default_factory=list)  # the records of its later mp.spawn worlds (not checked)
    ended_early: str = ""  # why the runner ended the job before it ended by itself

    @property
    def standin_sites(self) -> list:
        """Where in the script the CPU stand-in redirected a CUDA or NCCL call (distinct ``file:line``)."""
        return sorted({s for r in (*self.records.values(), self.parent) for s in r.get("standin", [])})

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


_PORTS: set = set()  # rendezvous ports given out in this process: two runs at once never share one
_PORTS_LOCK = threading.Lock()


def _port() -> int:
    from ddp_doctor.runner import free_port

    with _PORTS_LOCK:
        while (port := free_port()) in _PORTS:
            time.sleep(0.01)
        _PORTS.add(port)
        return port


SPAWNS = re.compile(r"\b(mp|multiprocessing|torch\.multiprocessing)\.(spawn|start_processes|Process)\s*\(|"
                    r"\bstart_processes\s*\(|(?<![\w.])spawn\s*\(\s*\w+\s*,\s*(args|nprocs)\s*=|\bProcess\s*\(\s*target\s*=")
CUDA = re.compile(r"cuda|nccl", re.IGNORECASE)


def _code(source: str) -> str:
    """The source without comments and docstrings (what the script does, not what it says)."""
    kept = []
    try:
        previous = tokenize.NEWLINE
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            docstring = tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            if tok.type not in (tokenize.COMMENT, tokenize.NL) and not docstring:
                kept.append(tok.string)
            if tok.type not in (tokenize.NL, tokenize.COMMENT):
                previous = tok.type
    except (tokenize.TokenError, SyntaxError):
        return source
    return " ".join(kept)


def style(script: Path, gpus: int, nproc: int) -> dict:
    """How to run ``script``, read from its code: the launch style, the CPU stand-in, a launch-style argument."""
    code = _code(script.read_text(errors="replace"))
    flag = next((f for f in ("--local-rank", "--local_rank") if f"'{f}'" in code or f'"{f}"' in code), "")
    standin = gpus < nproc and bool(CUDA.search(code))
    return {"launch": "spawn" if SPAWNS.search(code) else "torchrun", "standin": standin,
            "pretend": standin and not re.search(r"is_available|\baccelerator\b", code), "local_rank_arg": flag}


def _commands(job: Job, log_dir: str, plain: bool = False) -> list:
    from ddp_doctor.runner import plan, torchrun_command

    chosen = plan(job.nproc, allow_oversubscribe=True)
    script, args = (job.script, list(map(str, job.args))) if plain else (RECORDER, [str(job.script), *map(str, job.args)])
    if job.launch == "spawn":  # once, as its author runs it: the script starts its own processes
        port = _port()
        extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "COURSE_RECORD_PORT": str(port),
                 "COURSE_RECORD_GPUS": str(job.nproc)}
        return [("", [sys.executable, str(script), *args], {**chosen.env(), **extra})]
    env = {**chosen.env(), "COURSE_RECORD_PORT": str(_port())}  # for a tcp:// address the script writes itself
    if job.nodes == 1:
        return [("", torchrun_command(script, job.nproc, args, ["--log-dir", log_dir]), env)]
    port = _port()
    per_node = job.nproc // job.nodes
    return [(f"node{n}", torchrun_command(
        script, per_node, args, [f"--nnodes={job.nodes}", f"--node-rank={n}", "--rdzv-backend=c10d",
                                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=doctor-{port}",
                                   "--log-dir", os.path.join(log_dir, f"node{n}")],
        standalone=False), env) for n in range(job.nodes)]


def _read(folder: Path, prefix: str) -> dict:
    found = {}
    for f in folder.glob(f"{prefix}*.json"):
        try:
            found[int(f.stem.removeprefix(prefix))] = json.loads(f.read_text())
        except ValueError:
            pass
    return found


def _ended(out: Path, seen: dict) -> dict:
    """rank file -> whether that rank failed by an error of its script, for the ranks that have ended (their
    record's last version says so); ``seen``: what was read, by file and modification time (and the rank's pid)."""
    for f in out.glob("record_rank*.json"):
        try:
            stamp = f.stat().st_mtime_ns
            if seen.get(f.name, (None,))[0] != stamp:
                rec = json.loads(f.read_text())
                seen[f.name] = (stamp, rec.get("ended"), any(e.get("in") in ("script", "spawn")
                                                            for e in rec.get("errors", [])), rec.get("pid"))
        except (OSError, ValueError):
            continue
    return {name: failed for name, (_, ended, failed, _) in seen.items() if ended}


def _exited(pid) -> bool:
    """Whether a rank's process has exited (False when not known)."""
    from ddp_doctor.runner.processes import _running, psutil

    if not pid:
        return False
    try:
        return not _running(psutil.Process(pid))
    except psutil.Error:
        return True


def _said(out: Path, seen: dict) -> set:
    """The ranks that have ended, or said where they are (their stack, written after their record) and are not on
    their way out (a rank whose collective failed is waited for until its last record is there: 10 s at most)."""
    said = {name.removeprefix("record_").removesuffix(".json") for name in _ended(out, seen)}
    for f in out.glob("stuck_rank*.json"):
        try:
            if not json.loads(f.read_text()).get("leaving"):
                said.add(f.stem.removeprefix("stuck_"))
        except (OSError, ValueError):
            continue
    return said


def _stop_when_hung(out: Path, job: Job, stop: threading.Event, done: threading.Event, why: list) -> None:
    """End the job as torchrun would, and bounded: when a rank has failed (after a moment for the others to end
    by themselves), or at the timeout; first every rank still running says where it is (``dump-now``, also
    written by a rank whose collective timed out): its stack and then its record (the job is not stopped in the
    middle of it). When every rank has ended and exited but the job goes on, what is left is torchrun's agents of
    simulated nodes: an agent whose ranks succeeded waits up to 300 s in torchrun's exit barrier for an agent
    whose ranks failed, which never comes (it exits without it); the job is ended then ("exited")."""
    deadline, seen, failed_at, exited_at = time.monotonic() + job.timeout, {}, None, None
    while not done.wait(0.25):
        ended = _ended(out, seen)
        if failed_at is None and any(ended.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 2 and len(ended) < job.nproc:
            why.append("failed")
            break
        if job.launch == "torchrun" and job.nodes > 1 and len(ended) >= job.nproc and \
                all(_exited(seen[name][3]) for name in ended):
            exited_at = exited_at or time.monotonic()
            if time.monotonic() - exited_at > AGENTS_GRACE_S:
                why.append("exited")
                stop.set()
                return
        if time.monotonic() > deadline:
            why.append("timeout")
            break
    else:
        return
    if not (out / "dump-now").exists():  # else a rank whose wait timed out wrote it: a hang, said below
        why.append("runner")
    (out / "dump-now").touch()
    until = time.monotonic() + 10
    while time.monotonic() < until and not done.is_set() and len(_said(out, seen)) < job.nproc:
        time.sleep(0.1)
    stop.set()


AGENTS_GRACE_S = 5  # every rank has exited: torchrun's agents end within this unless one waits in its exit barrier


def run(job: Job, out: Path, on_line=None, plain: bool = False, files: Path | None = None) -> Run:
    """Run ``job`` with its records in ``out`` (created); the learner's files are put back afterwards, what the
    run created moved to ``files`` (default ``out/files``). plain=True: the script alone, without the recorder
    (for measuring what the recorder costs). An interrupt (Ctrl+C) ends every process and puts the files back
    before it goes on."""
    from ddp_doctor.runner import LaunchError, run_commands
    from ddp_doctor.runner.processes import log_folder

    out.mkdir(parents=True)
    log_dir = log_folder()  # named after this process: removed after the job, or by the next launch if we die
    env = {"COURSE_RECORD_OUT": str(out), "COURSE_RECORD_TRAINING": "1", "COURSE_RECORD_PROTECT": "1",
           "COURSE_RECORD_STEPS": str(job.steps), "COURSE_RECORD_PG_TIMEOUT": str(job.hang_after),
           "COURSE_RECORD_SINCE": str(time.time()), "TORCH_FR_BUFFER_SIZE": "4000",
           "COURSE_RECORD_LAUNCH": job.launch if job.launch == "spawn" else "",
           "COURSE_RECORD_STANDIN": "1" if job.standin else "", "COURSE_RECORD_PRETEND": "1" if job.pretend else "",
           "COURSE_RECORD_LOCAL_RANK_ARG": job.local_rank_arg}
    jobs = [(label, cmd, {**extra, **env}) for label, cmd, extra in _commands(job, log_dir, plain)]
    stop, done, why = threading.Event(), threading.Event(), []
    watcher = threading.Thread(target=_stop_when_hung, args=(out, job, stop, done, why), daemon=True)
    watcher.start()
    start = time.monotonic()
    lines: list[str] = []
    try:
        result = run_commands(jobs, timeout=job.timeout + 30, on_line=on_line or lines.append, stop=stop,
                              cwd=job.cwd, _remove=[log_dir], where=False)  # the recorder says where ranks are
        code, output, failure = result.returncode, result.output, result.failure or ""
    except LaunchError as error:  # stopped: a hang, a rank failed and the others were ended, or the ranks had exited
        output = error.output or "".join(lines)
        code, failure = (1, "") if why[:1] == ["failed"] else (None, "")
        if why == ["exited"]:  # what the ranks ended with, as if torchrun's agents had exited with them
            code = int(any(_ended(out, {}).values()))
        if code:
            from ddp_doctor.runner import describe_failure

            failure = describe_failure(output, code) or ""
    except KeyboardInterrupt:
        done.set()
        _put_back(Run(job, None, "", _read(out, "record_rank"), {}, time.monotonic() - start, parent=_parent(out),
                      later=_later(out)), out, files or out / "files")
        raise
    finally:
        done.set()
        shutil.rmtree(log_dir, ignore_errors=True)
    (out / "output.txt").write_text(output)
    records = _read(out, "record_rank")
    # where the ranks were: at the timeout, or when a rank's wait timed out (a hang); not after a rank's own error
    stuck = _read(out, "stuck_rank") if why != ["failed", "runner"] else {}
    # a rank failed and others had not ended: ended by the runner, or by torchrun itself if it was quicker
    ended = _ended(out, {})
    others_ended = code and (why[:1] == ["failed"] or (any(ended.values()) and len(ended) < job.nproc))
    run = Run(job, code, output, records, stuck, time.monotonic() - start, failure, parent=_parent(out), later=_later(out),
              ended_early="a rank failed: the others were ended, as torchrun ends them" if others_ended else "")
    _put_back(run, out, files or out / "files")
    return run


def _parent(out: Path) -> dict:
    try:
        return json.loads((out / "record_parent.json").read_text())
    except (OSError, ValueError):
        return {}


def _later(out: Path) -> list:
    """The records of the processes of a script's later ``mp.spawn`` calls (``record_job<N>_rank<R>.json``)."""
    found = []
    for f in sorted(out.glob("record_job*_rank*.json")):
        try:
            found.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return found


def _put_back(run: Run, out: Path, files: Path) -> None:
    """Restore what the script overwrote or deleted; move what it created into ``files``; drop folders it
    created. The copies are found by their own ``.path`` notes too: a rank ended before it wrote its record."""
    records = [*run.records.values(), run.parent, *run.later]
    protected = {p: s for r in records for p, s in r.get("protected", {}).items()}
    for note in (out / "protected").glob("*.path"):
        try:
            protected.setdefault(note.read_text(), str(note.with_suffix("")))
        except OSError:
            pass
    for path, saved in protected.items():
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.doctor-restore"
            shutil.copy2(saved, tmp)
            os.replace(tmp, path)
            run.restored.append(path)
        except OSError:
            run.lost.append(path)
    cwd = str(run.job.cwd.resolve())
    # A rank that wrote a file after another rank had overwritten it in this run sees it as new: the file was
    # there before the run all the same (protected), so it is restored, never moved.
    for path in sorted({p for r in records for p in r.get("created", [])} - protected.keys()):
        if not os.path.isfile(path):
            continue
        inside = path.startswith(cwd + os.sep)
        target = files / (os.path.relpath(path, cwd) if inside else path.lstrip(os.sep))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, target)
        run.moved.append(path)
    for folder in sorted({d for r in records for d in r.get("dirs", [])}, key=len, reverse=True):
        try:
            os.rmdir(folder)  # only if empty: what the script put there has been moved
        except OSError:
            pass
    shutil.rmtree(out / "protected", ignore_errors=True)
