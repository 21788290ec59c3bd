"""Running a learner's script for the doctor: N processes under the recorder (``course/recorder/recorder.py``), on one node
or as simulated nodes, bounded by a timeout; a hang is stopped only after every rank has said where it was. After
the run the learner's folders are as they were: files the script overwrote are restored, files it created are
moved into the doctor's folder."""

import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.recorder import ENTRY as RECORDER


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
    restored: list = field(default_factory=list)  # files the run overwrote, restored

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


_PORTS: set = set()  # rendezvous ports given out in this process: two runs at once never share one
_PORTS_LOCK = threading.Lock()


def _port() -> int:
    from course.launcher import free_port

    with _PORTS_LOCK:
        while (port := free_port()) in _PORTS:
            time.sleep(0.01)
        _PORTS.add(port)
        return port


def _commands(job: Job, log_dir: str, plain: bool = False) -> list:
    from course.launcher import plan, torchrun_command

    chosen = plan(job.nproc, allow_oversubscribe=True)
    script, args = (job.script, list(map(str, job.args))) if plain else (RECORDER, [str(job.script), *map(str, job.args)])
    if job.nodes == 1:
        return [("", torchrun_command(script, job.nproc, args, ["--log-dir", log_dir]), chosen.env())]
    port = _port()
    per_node = job.nproc // job.nodes
    return [(f"node{n}", torchrun_command(
        script, per_node, args, [f"--nnodes={job.nodes}", f"--node-rank={n}", "--rdzv-backend=c10d",
                                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=doctor-{port}",
                                   "--log-dir", os.path.join(log_dir, f"node{n}")],
        standalone=False), chosen.env()) for n in range(job.nodes)]


def _read(folder: Path, prefix: str) -> dict:
    found = {}
    for f in folder.glob(f"{prefix}*.json"):
        try:
            found[int(f.stem.removeprefix(prefix))] = json.loads(f.read_text())
        except ValueError:
            pass
    return found


def _stop_when_hung(out: Path, job: Job, stop: threading.Event, done: threading.Event) -> None:
    """At the timeout, ask every rank where it is (``dump-now``), give them a moment to say, then stop the job."""
    if done.wait(job.timeout):
        return
    (out / "dump-now").touch()
    deadline = time.monotonic() + 10
    while len(list(out.glob("stuck_rank*.json"))) < job.nproc and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()


def run(job: Job, out: Path, on_line=None, plain: bool = False) -> Run:
    """Run ``job`` with its records in ``out`` (created); the learner's files are put back afterwards.
    plain=True: the script alone, without the recorder (for measuring what the recorder costs)."""
    from course.launcher import LaunchError, run_commands

    out.mkdir(parents=True)
    log_dir = tempfile.mkdtemp(prefix="course-torchrun-")
    env = {"COURSE_RECORD_OUT": str(out), "COURSE_RECORD_TRAINING": "1", "COURSE_RECORD_PROTECT": "1",
           "COURSE_RECORD_STEPS": str(job.steps), "COURSE_RECORD_PG_TIMEOUT": str(job.hang_after),
           "COURSE_RECORD_SINCE": str(time.time()), "TORCH_FR_BUFFER_SIZE": "4000"}
    jobs = [(label, cmd, {**extra, **env}) for label, cmd, extra in _commands(job, log_dir, plain)]
    stop, done = threading.Event(), threading.Event()
    watcher = threading.Thread(target=_stop_when_hung, args=(out, job, stop, done), daemon=True)
    watcher.start()
    start = time.monotonic()
    lines: list[str] = []
    try:
        result = run_commands(jobs, timeout=job.timeout + 30, on_line=on_line or lines.append, stop=stop,
                              cwd=job.cwd, _remove=[log_dir])
        code, output, failure = result.returncode, result.output, result.failure or ""
    except LaunchError as error:  # stopped: a hang
        code, output, failure = None, error.output or "".join(lines), ""
    finally:
        done.set()
    (out / "output.txt").write_text(output)
    records = _read(out, "record_rank")
    run = Run(job, code, output, records, _read(out, "stuck_rank"), time.monotonic() - start, failure)
    _put_back(run, out)
    return run


def _put_back(run: Run, out: Path) -> None:
    """Restore what the script overwrote; move what it created into ``out/files``; drop folders it created."""
    records = run.records.values()
    protected = {p: s for r in records for p, s in r.get("protected", {}).items()}
    for path, saved in protected.items():
        if os.path.exists(saved):
            tmp = f"{path}.doctor-restore"
            shutil.copy2(saved, tmp)
            os.replace(tmp, path)
            run.restored.append(path)
    cwd = str(run.job.cwd.resolve())
    # A rank that wrote a file after another rank had overwritten it in this run sees it as new: the file was
    # there before the run all the same (protected), so it is restored, never moved.
    for path in sorted({p for r in records for p in r.get("created", [])} - protected.keys()):
        if not os.path.isfile(path):
            continue
        inside = path.startswith(cwd + os.sep)
        target = out / "files" / (os.path.relpath(path, cwd) if inside else path.lstrip(os.sep))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, target)
        run.moved.append(path)
    for folder in sorted({d for r in records for d in r.get("dirs", [])}, key=len, reverse=True):
        try:
            os.rmdir(folder)  # only if empty: what the script put there has been moved
        except OSError:
            pass
    shutil.rmtree(out / "protected", ignore_errors=True)
