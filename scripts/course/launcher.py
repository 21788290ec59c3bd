"""Launch ``torchrun`` from a notebook cell: live output tagged by rank, a wall-clock timeout,
one clear message naming the failing rank, and no process left behind.

    from course.launcher import launch, show_report
    result = launch("train_ddp.py", nproc=2, args=["--epochs", "1"], run_dir="runs/03/np2")
    show_report(result)        # the full output, collapsed (a click opens it)

Why not ``!torchrun ...``? A failing ``!`` command does not fail the notebook, has no timeout,
and an interrupted cell can leave ranks behind. Here torchrun runs in its own process session;
on success, failure, timeout, Stop or cell interrupt the whole process tree is ended, and a small
watchdog process ends it too when the process that launched it dies (a killed or crashed kernel).

Working directory: the repository root (what the course's scripts expect), unless ``cwd=`` says
otherwise, e.g. for a script of your own that writes relative paths.
"""

import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from course import ROOT, SCRIPTS
from course.hardware import accelerator_name, choose, cpu_cores


class LaunchError(RuntimeError):
    """A launched job exited non-zero, timed out or was stopped; the message names the failing rank.

    output: everything the job printed (torchrun's own report included); failure: the short text;
    result: the RunResult (None when the job was cut short). ``show_report(err)`` shows the output.
    """

    def __init__(self, message: str, *, output: str = "", failure: str | None = None, result=None):
        super().__init__(message)
        self.output, self.failure, self.result = output, failure or message, result


class LaunchRefused(ValueError):
    """A launch that ``plan()`` refuses before anything starts (e.g. more CPU ranks than cores)."""


@dataclass
class RunResult:
    returncode: int
    wall_time: float
    output: str
    run_dir: Path | None = None
    metrics: dict | None = None
    returncodes: list[int] = field(default_factory=list)
    failure: str | None = None  # on failure: the first failing rank with something to say, and its last lines


@dataclass
class Plan:
    """What a launch will use, decided from the hardware before anything starts (course.hardware's rule)."""

    nproc: int
    backend: str  # the process-group backend of the ranks: "gloo", "nccl", "xccl", ...
    device: str  # the device type: "cpu", "cuda", "xpu", "mps" (mps: a single plain process only)
    threads_per_rank: int
    reason: str
    refusal: str | None = None  # why launch() refuses this plan (None: it runs)
    accelerator: str | None = None  # what the machine has, e.g. "cuda" (None: nothing)
    accelerators: int = 0

    @property
    def device_type(self) -> str:
        return self.device


def plan(nproc: int, backend: str = "auto", *, allow_oversubscribe: bool = False, report=None) -> Plan:
    """Choose backend, device and CPU threads per rank with course.hardware's rule; decide refusals.

    Raises ValueError for what cannot work (nccl without a GPU per process). What works but only
    makes things worse (more CPU ranks than cores) is recorded in ``refusal``: launch() and the
    widget refuse it, unless ``allow_oversubscribe=True`` (to demonstrate oversubscription).
    report: a faked (accelerator type, count), for tests.
    """
    from course.hardware import accelerator

    acc, count = report if report is not None else accelerator()
    chosen = choose(nproc, backend, ranks=True, report=(acc, count))
    device, reason = chosen.device_type, chosen.reason
    if nproc == 1:
        plain = choose(1, backend, ranks=False, report=(acc, count))
        if plain.device_type != device:  # MPS: a plain script uses it, a process group cannot
            device = plain.device_type
            reason = (f"1 process: a plain script uses the {accelerator_name(acc)}; a script that starts a "
                      f"process group uses {chosen.backend} on {chosen.device_type} ({chosen.reason})")
    if device == "cpu":
        reason += "; these are CPU numbers"
    # Threads: split the cores between ranks; more threads than cores makes every rank slower.
    cores = cpu_cores()
    threads = max(1, cores // nproc)
    refusal = None
    if device == "cpu" and nproc > cores and not allow_oversubscribe:
        refusal = (f"{nproc} processes on the CPU, but this machine has {cores} CPU cores. Each rank needs a "
                   f"core of its own: more ranks than cores fight over them and the run gets slower, not "
                   f"faster. Use at most {cores} processes.")
    return Plan(nproc, chosen.backend, device, threads, reason, refusal, acc, count)


RENDEZVOUS_FLAGS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
                    "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--master-addr", "--master_addr", "--master-port",
                    "--master_port")


def torchrun_command(script: str | Path, nproc: int, args=(), torchrun_args=(), standalone: bool = True) -> list[str]:
    """The torchrun command line, output tagged by rank (``--tee=3 --role=rank``: lines start ``[rankN]:``).

    standalone=True: one node, its rendezvous on a free port (``--standalone``); rendezvous flags in
    ``torchrun_args`` are refused, since --standalone would silently override them.
    standalone=False: the caller gives the rendezvous in ``torchrun_args``, e.g. two simulated nodes:
    ``["--nnodes=2", "--node-rank=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]``
    (or ``--master-addr``/``--master-port``).
    """
    torchrun_args = [str(a) for a in torchrun_args]
    if standalone:
        clash = [a for a in torchrun_args if a.split("=", 1)[0] in RENDEZVOUS_FLAGS]
        if clash:
            raise ValueError(f"{' '.join(clash)}: rendezvous flags need standalone=False "
                             "(--standalone picks its own rendezvous and would ignore them)")
    return [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else []),
            f"--nproc-per-node={nproc}", "--tee=3", "--role=rank", *torchrun_args, str(resolve_script(script)),
            *map(str, args)]


def resolve_script(script: str | Path, cwd=None) -> Path:
    """A script name as given (relative to ``cwd`` if given, else to the working directory), else
    relative to the repository, else to scripts/."""
    places = ([Path(cwd) / script] if cwd is not None else []) + [Path(script), ROOT / script, SCRIPTS / script]
    for path in places:
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(f"no such script: {script} (looked here, in {ROOT} and in {SCRIPTS})")


def _in_root(path) -> Path:
    path = Path(path).expanduser()
    return path if path.is_absolute() else ROOT / path


def launch(script: str | Path, nproc: int = 1, args=(), *, backend: str = "auto", run_dir=None,
           env: dict | None = None, timeout: float = 600, check: bool = True, torchrun_args=(),
           on_line=None, stop: threading.Event | None = None, quiet: bool = False, cwd=None,
           standalone: bool = True, allow_oversubscribe: bool = False) -> RunResult:
    """Run ``script`` under torchrun with ``nproc`` processes and stream its output live.

    run_dir: passed to the script as ``--run-dir``; its metrics.json is returned in the result.
    timeout: seconds of wall time before every process is stopped and LaunchError raised.
    check: raise LaunchError naming the failing rank and its last error lines when the job fails
      (``result.failure`` holds the same text with check=False).
    on_line: called with each output line (default: print); stop: an Event that ends the job.
    cwd: the working directory of the ranks (default: the repository root, as the course's scripts
      expect); relative paths are relative to the repository root, like run_dir.
    standalone: False when ``torchrun_args`` carry the rendezvous (see ``torchrun_command``).
    allow_oversubscribe: run more CPU ranks than cores instead of refusing (LaunchRefused).
    """
    chosen = plan(nproc, backend, allow_oversubscribe=allow_oversubscribe)
    if chosen.refusal:
        raise LaunchRefused(f"{chosen.refusal} (To see what it does anyway: allow_oversubscribe=True.)")
    workdir = ROOT if cwd is None else _in_root(cwd)
    if not workdir.is_dir():
        raise FileNotFoundError(f"cwd: no such folder: {workdir}")
    script_path = resolve_script(script, cwd=workdir if cwd is not None else None)
    args = list(args)
    if run_dir is not None:
        run_dir = _in_root(run_dir)
        args += ["--run-dir", str(run_dir)]
    torchrun_args = [str(a) for a in torchrun_args]
    log_dir = None
    if not any(a.split("=", 1)[0] in ("--log-dir", "--log_dir") for a in torchrun_args):
        # torchrun keeps per-rank logs and error files (@record) there; ours is removed after the job.
        log_dir = tempfile.mkdtemp(prefix="course-torchrun-")
        torchrun_args = ["--log-dir", log_dir, *torchrun_args]
    cmd = torchrun_command(script_path, nproc, args, torchrun_args, standalone=standalone)
    job_env = {"OMP_NUM_THREADS": str(chosen.threads_per_rank), **(env or {})}
    if chosen.device == "cpu" and chosen.accelerator == "cuda" and chosen.accelerators > 0:
        job_env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on a GPU box: keep every rank on the CPU
    emit = on_line or _print_line
    if not quiet:
        emit(f"[launcher] {nproc} process(es), {chosen.backend} on {chosen.device} ({chosen.reason}); "
             f"{chosen.threads_per_rank} CPU thread(s) per rank\n")
        emit(f"[launcher] $ {_shell_form(cmd, log_dir)}\n")
    try:
        result = run_commands([("", cmd, job_env)], timeout=timeout, on_line=emit, stop=stop, cwd=workdir,
                              _remove=[log_dir] if log_dir else [])
    finally:
        if log_dir:  # run_commands has read the error files it needed
            shutil.rmtree(log_dir, ignore_errors=True)
    result.run_dir = run_dir
    metrics_file = run_dir / "metrics.json" if run_dir else None
    if metrics_file and metrics_file.exists() and metrics_file.stat().st_mtime >= time.time() - result.wall_time - 1:
        result.metrics = json.loads(metrics_file.read_text())
    if not quiet:
        emit(f"[launcher] exit code {result.returncode} after {result.wall_time:.1f} s\n")
    if check and result.returncode != 0:
        raise LaunchError(f"{Path(script).name} failed (exit code {result.returncode}): {result.failure}\n"
                          "(full output: course.launcher.show_report(error), or error.output)",
                          output=result.output, failure=result.failure, result=result)
    return result


def run_commands(jobs, *, timeout: float = 600, on_line=None, stop: threading.Event | None = None,
                 cwd: Path = ROOT, _remove=()) -> RunResult:
    """Run several commands at once (e.g. two simulated nodes), merging their output live.

    jobs: list of (label, argv, extra_env); a non-empty label prefixes each of that job's lines.
    Returns when all have exited; on timeout, stop or KeyboardInterrupt every process tree is ended,
    and a watchdog ends them if this process dies. torchrun's own failure report (its traceback and
    the ChildFailedError block) is kept in ``output`` but not streamed: ``failure`` says it in short.
    """
    emit = on_line or _print_line
    lines: queue.Queue = queue.Queue()
    procs, captured = [], []
    start = time.monotonic()
    reason = None
    watchdog = None
    open_streams = 0  # output pumps still running

    def take(wait: float) -> None:
        """Show and keep the next line, if one comes within ``wait`` s; count the streams that close."""
        nonlocal open_streams
        try:
            item = lines.get(timeout=wait)
        except queue.Empty:
            return
        if item is None:
            open_streams -= 1
            return
        line, shown = item
        captured.append(line)
        if shown:
            emit(line)

    try:
        for label, argv, extra_env in jobs:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
            # Own session: a notebook interrupt (SIGINT to the kernel's group) reaches us, not the ranks,
            # so that we, not a half-delivered signal, decide how they end.
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                                    errors="replace", bufsize=1)
            procs.append(proc)
            prefix = f"[{label}] " if label else ""
            threading.Thread(target=_pump, args=(proc, prefix, lines), daemon=True).start()
            open_streams += 1
        watchdog = start_watchdog([p.pid for p in procs], remove=_remove)
        while open_streams:
            take(0.1)
            if time.monotonic() - start > timeout:
                reason = f"timed out after {timeout:.0f} s"
                break
            if stop is not None and stop.is_set():
                reason = "stopped"
                break
        if reason is None:
            for proc in procs:
                proc.wait()  # every stream is closed, so this returns at once
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    finally:
        if reason is not None:
            ended = sum(kill_tree(p.pid) for p in procs)
            # What the processes wrote before they ended may still be in the pipes (torchrun copies its
            # ranks' log files to its stdout as it stops): keep it, it can say why the job was stopped.
            deadline = time.monotonic() + 5
            while open_streams and time.monotonic() < deadline:
                take(0.1)
            emit(f"[launcher] {reason}: ended {ended} process(es)\n")
        if watchdog is not None:
            watchdog.kill()  # the job is over (or ended above): nothing left to watch
            watchdog.wait()
    output = "".join(captured)
    codes = [p.returncode for p in procs]
    if reason is not None:
        raise LaunchError(f"job {reason}; every process was ended (its output is above).", output=output,
                          failure=f"job {reason}")
    code = next((c for c in codes if c != 0), 0)
    return RunResult(returncode=code, wall_time=time.monotonic() - start, output=output, returncodes=codes,
                     failure=describe_failure(output, code) if code else None)


# torchrun copies each rank's output to its own, a tag per line; a line a rank has not finished (a tqdm
# bar, redrawn after "\r" with no newline) is copied as it is, so the next line (another rank's, or
# torchrun's own log) lands after it. Such a line is cut where the next one starts: before a rank tag
# (not one that follows a tag: torch's errors are "[rank1]:[rank1]: ...") or a torchrun log header.
GLUED = re.compile(r"(?<=\S)(?<!\]:)(?=\[rank\d+\]:)|(?<=\S)(?=[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ )")


def unglue(line: str) -> list[str]:
    """``line`` cut into the lines torchrun glued together, each ending in a newline."""
    return [part if part.endswith("\n") else part + "\n" for part in GLUED.split(line) if part]


def _pump(proc: subprocess.Popen, prefix: str, lines: queue.Queue) -> None:
    report = _TorchrunReport()
    for line in proc.stdout:
        for text, shown in (item for part in unglue(line) for item in report.feed(part)):
            lines.put((prefix + text, shown))
    for text, shown in report.flush():
        lines.put((prefix + text, shown))
    proc.stdout.close()
    proc.wait()
    lines.put(None)


class _TorchrunReport:
    """Tells torchrun's own failure report apart from the ranks' output, line by line.

    Hidden from the live stream (kept in the output): torchrun's traceback that ends in ChildFailedError,
    the report block after it, and its log lines about the failure. A traceback of torchrun itself that
    ends in anything else (a rendezvous error, a bad option) is the cause of the failure: it is shown.
    """

    LOG = re.compile(r"^[WEI]\d{4} .*\] (failed \(exitcode|no error file defined|Sending process \d+ closing)")

    def __init__(self):
        self.held: list[str] = []  # a torchrun traceback, until its last line says what it is
        self.in_report = False
        self.seen_root = False

    def feed(self, line: str) -> list[tuple[str, bool]]:
        if self.in_report:
            if line.startswith("Root Cause"):
                self.seen_root = True
            elif self.seen_root and line.startswith("====="):
                self.in_report = self.seen_root = False
            return [(line, False)]
        if self.held:
            if line.startswith((" ", "Traceback")) or not line.strip():
                self.held.append(line)
                return []
            held, self.held = self.held, []
            if "ChildFailedError" in line:
                self.in_report = True
                return [(text, False) for text in [*held, line]]
            return [(text, True) for text in [*held, line]]
        if line.startswith("Traceback (most recent call last):"):
            self.held = [line]
            return []
        return [(line, not self.LOG.match(line))]

    def flush(self) -> list[tuple[str, bool]]:
        held, self.held = self.held, []
        return [(text, True) for text in held]


# ---------------------------------------------------------------------------- explaining a failure

TAGGED = re.compile(r"^(?:\[[^\]]*\] )?\[rank(\d+)\]:(?:\[rank\d+\]: ?)?(.*)$")
ENTRY = re.compile(r"rank\s+: (\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s+: (-?\d+)[^\n]*\n"
                   r"\s*error_file: ([^\n]*)\n\s*traceback : (.*?)(?=\n\[\d+\]:|\n-{20}|\n={20}|\Z)", re.DOTALL)
ERRORISH = re.compile(r"(^|\W)(error|exception)\b", re.IGNORECASE)
LIBRARY = ("site-packages", "/lib/python3.", '"<frozen ')
VICTIM = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer")


def describe_failure(output: str, returncode: int | None = None) -> str:
    """A short text naming the first failing rank that has something to say, with its last error lines.

    Sources, best first: the rank's error file (torchrun's report, from @record); else that rank's own
    tagged output (``[rankN]:`` lines: a traceback, ``error: ...`` from argparse or a SystemExit). Ranks
    that only report a dead peer ("Connection closed by peer") and ranks torchrun stopped come last.
    Without torchrun's report (torchrun itself failed) it is the output's last lines.
    """
    by_rank: dict[int, list[str]] = {}
    for line in output.splitlines():
        tagged = TAGGED.match(line)
        if tagged:
            by_rank.setdefault(int(tagged[1]), []).append(tagged[2].rstrip())
    failures = _report_entries(output)
    if not failures:  # no report: torchrun itself failed, or a job that is not torchrun
        said = [(rank, _last_error_lines(lines)) for rank, lines in sorted(by_rank.items())]
        said = [(rank, lines) for rank, lines in said if lines]
        if said:
            rank, lines = min(said, key=lambda item: _is_victim(item[1]))
            return f"rank {rank}" + _indent(lines)
        code = f"exit code {returncode}" if returncode is not None else "failed"
        return code + _indent(_tail(output, 12))
    candidates = sorted(failures, key=lambda f: (f["exitcode"] <= 0, f["order"]))
    best = None
    for entry in candidates:
        lines = _from_error_file(entry) or _last_error_lines(by_rank.get(entry["rank"], []))
        if lines and (best is None or (best[2] and not _is_victim(lines))):
            best = (entry, lines, _is_victim(lines))
            if not best[2]:
                break
    if best is None:
        entry = candidates[0]
        return f"{_who(entry)} (it printed no error)" + _indent(_tail("\n".join(by_rank.get(entry["rank"], [])), 8))
    who = _who(best[0])
    first = candidates[0]
    if best[0]["exitcode"] < 0 and first["exitcode"] > 0:  # it said why, then torchrun stopped it
        who = f"rank {best[0]['rank']} (stopped by torchrun after {_who(first)})"
    return who + _indent(best[1])


def _report_entries(output: str) -> list[dict]:
    """torchrun's ChildFailedError report: one dict per failed rank, the root cause first."""
    start = output.rfind("Root Cause (first observed failure)")
    if start < 0:
        return []
    block_start = output.rfind("Failures:", 0, start)
    end = output.find("=" * 20, start)
    root = output[start:end if end > 0 else None]
    others = output[block_start:start] if block_start >= 0 else ""
    entries = []
    for order, match in enumerate([*ENTRY.finditer(root), *ENTRY.finditer(others)]):
        rank, local_rank, code, error_file, message = match.groups()
        entries.append({"rank": int(rank), "local_rank": int(local_rank), "exitcode": int(code),
                        "error_file": error_file.strip(), "message": message.strip(), "order": order})
    return entries


def _from_error_file(entry: dict) -> list[str]:
    """The traceback a rank wrote with @record: from its error file, else from the report's copy."""
    if entry["error_file"] in ("", "<N/A>"):
        return []
    text = "\n".join(line.removeprefix("  ") for line in entry["message"].splitlines())
    try:
        data = json.loads(Path(entry["error_file"]).read_text())
        message = data["message"]
        text = message["extraInfo"]["py_callstack"] if isinstance(message, dict) else str(message)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return _last_error_lines([line.rstrip() for line in text.splitlines()])


def _last_error_lines(lines: list[str], frames: int = 2) -> list[str]:
    """What a rank said about its failure: its last traceback (the last ``frames`` frames outside installed
    libraries, and the exception line), else its error-like lines (``error: ...``); [] if nothing."""
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent call last)")]
    if not starts:
        return [line for line in lines if ERRORISH.search(line)][-4:]
    stack, exception = [], []
    for line in lines[starts[-1] + 1:]:
        if not line.strip() or set(line.strip()) <= set("^~"):
            continue
        if not line.startswith(" "):
            exception = [line]  # the exception line ends the traceback; later lines belong to other output
            break
        if line.lstrip().startswith("File "):
            stack.append([line])
        elif stack:
            stack[-1].append(line)
    own = [frame for frame in stack if not any(lib in frame[0] for lib in LIBRARY)] or stack
    return [line for frame in own[-frames:] for line in frame] + exception


def _is_victim(lines: list[str]) -> bool:
    return any(marker in line for line in lines for marker in VICTIM)


def _who(entry: dict) -> str:
    code = entry["exitcode"]
    how = f"exited with code {code}" if code >= 0 else f"was ended by {_signal_name(-code)}"
    local = f" (local rank {entry['local_rank']})" if entry["local_rank"] != entry["rank"] else ""
    return f"rank {entry['rank']}{local} {how}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _indent(lines: list[str]) -> str:
    return ":\n" + "\n".join("  " + line for line in lines) if lines else ""


def _tail(text: str, n: int) -> list[str]:
    return [line for line in text.rstrip().splitlines() if line.strip()][-n:]


def show_report(result_or_error) -> None:
    """The full output of a run (a RunResult or a LaunchError), collapsed: in a notebook an HTML
    <details> block one click away, elsewhere plain text."""
    output = getattr(result_or_error, "output", "") or "(no output)"
    failure = getattr(result_or_error, "failure", None)
    title = f"failed: {failure.splitlines()[0]}" if failure else "finished"
    summary = f"full output ({len(output.splitlines())} lines); {title}"
    shell = None
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        pass
    if shell is None or not hasattr(shell, "kernel"):
        print(f"---- {summary}\n{output.rstrip()}\n----")
        return
    import html

    from IPython.display import HTML, display

    display(HTML(f"<details><summary>{html.escape(summary)}</summary>"
                 f'<pre style="max-height:420px;overflow:auto;font-size:12px">{html.escape(output)}</pre>'
                 "</details>"))


# ---------------------------------------------------------------------------- no process left behind

def start_watchdog(pids: list[int], remove=()) -> subprocess.Popen:
    """A small process that ends these process trees (and removes the ``remove`` folders) when this
    process dies by any signal, SIGKILL included, as when a notebook kernel is killed. It exits by
    itself when they have all ended. Same on Linux and macOS (it polls; no Linux-only prctl)."""
    code = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); from course.launcher import _watch; "
            f"_watch({os.getpid()}, {psutil.Process().create_time()!r}, {list(pids)!r}, {[str(r) for r in remove]!r})")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _watch(parent: int, created: float, pids: list[int], remove: list[str], poll: float = 0.5) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watched: dict[int, psutil.Process] = {}

    def refresh():  # the ranks too: if torchrun died first they would no longer be its children
        for pid in list(pids):
            try:
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    watched.setdefault(proc.pid, proc)
            except psutil.Error:
                pass
        for pid, proc in list(watched.items()):
            if not _running(proc):
                del watched[pid]

    def parent_alive() -> bool:
        try:
            proc = psutil.Process(parent)
            return abs(proc.create_time() - created) < 1 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    refresh()
    ticks = 0
    while watched:
        if not parent_alive():
            refresh()
            _end(list(watched.values()), grace=1)  # nobody reads the output any more: no need to wait long
            for folder in remove:
                shutil.rmtree(folder, ignore_errors=True)
            return
        time.sleep(poll)
        ticks += 1
        if ticks % 4 == 0:
            refresh()
        else:
            watched = {pid: p for pid, p in watched.items() if _running(p)}


def _end(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after ``grace`` s (zombies count as ended)."""
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    for signal_after_grace in (True, False):
        deadline = time.monotonic() + grace
        while True:
            alive = [p for p in procs if _running(p)]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not signal_after_grace:
            break
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass


def _running(proc: psutil.Process) -> bool:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            proc.wait(0)  # our own child: reap it; another process's zombie: its parent will
            return False
        return proc.is_running()
    except (psutil.Error, ChildProcessError):
        return False


def free_port(preferred: int | None = None) -> int:
    """``preferred`` if nothing listens there, else any free port of 127.0.0.1."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def kill_tree(pid: int, grace: float = 5.0) -> int:
    """End a process and all its descendants (SIGTERM, then SIGKILL after ``grace`` s); returns the count."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    _end(procs, grace)
    return len(procs)


def root_cause(output: str) -> str:
    """torchrun's 'Root Cause' block (the failing rank's traceback, thanks to @record), else the tail."""
    start = output.find("Root Cause (first observed failure)")
    if start >= 0:
        end = output.find("=" * 20, start)
        return output[start:end if end > 0 else None].rstrip()
    return "\n".join(output.rstrip().splitlines()[-25:])


def _shell_form(cmd: list[str], log_dir: str | None = None) -> str:
    shown = ["torchrun", *cmd[3:]] if cmd[1:3] == ["-m", "torch.distributed.run"] else list(cmd)
    if log_dir and log_dir in shown:  # the launcher's own temporary log folder: not the learner's concern
        at = shown.index(log_dir)
        del shown[at - 1:at + 1]
    return " ".join(shlex.quote(str(Path(c).relative_to(ROOT)) if str(c).startswith(str(ROOT) + "/") else c)
                    for c in shown)


def _print_line(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()
