"""Launch ``torchrun`` from a notebook cell: live output tagged by rank, a wall-clock timeout,
the failing rank's real traceback, and no process left behind.

    from course.launcher import launch
    result = launch("train_ddp.py", nproc=2, args=["--epochs", "1"], run_dir="runs/03/np2")

Why not ``!torchrun ...``? A failing ``!`` command does not fail the notebook, has no timeout,
and an interrupted cell can leave ranks behind. Here torchrun runs in its own process session;
on success, failure, timeout, Stop or cell interrupt the whole process tree is ended.
"""

import json
import os
import queue
import shlex
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from course import ROOT, SCRIPTS
from course.hardware import accelerator_count, cpu_cores


class LaunchError(RuntimeError):
    """A launched job exited non-zero, timed out or was stopped; the message carries the root cause."""


@dataclass
class RunResult:
    returncode: int
    wall_time: float
    output: str
    run_dir: Path | None = None
    metrics: dict | None = None
    returncodes: list[int] = field(default_factory=list)


@dataclass
class Plan:
    """What a launch will use, decided from the hardware before anything starts."""

    nproc: int
    backend: str  # "nccl" or "gloo"
    device: str  # "cuda" or "cpu"
    threads_per_rank: int
    reason: str


def plan(nproc: int, backend: str = "auto") -> Plan:
    """Choose backend, device and CPU threads per rank; refuse combinations that cannot work."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    gpus = accelerator_count()
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and gpus < nproc:
        raise ValueError(f"nccl needs one GPU per process: {nproc} processes requested, {gpus} GPUs found. "
                         "Use backend='gloo' (CPU) or fewer processes.")
    # Threads: split the cores between ranks; more threads than cores makes every rank slower.
    threads = max(1, cpu_cores() // nproc)
    if backend != "gloo" and 0 < nproc <= gpus:
        return Plan(nproc, "nccl", "cuda", threads, f"{gpus} GPUs found: one process per GPU, nccl")
    reason = ("no GPU found" if gpus == 0 else
              f"{nproc} processes > {gpus} GPUs" if backend == "auto" else "gloo requested")
    return Plan(nproc, "gloo", "cpu", threads, f"{reason}: gloo on CPU, these are CPU numbers")


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


def resolve_script(script: str | Path) -> Path:
    """A script name as given, else relative to the repository, else to scripts/."""
    for path in (Path(script), ROOT / script, SCRIPTS / script):
        if path.exists():
            return path.resolve()
    raise FileNotFoundError(f"no such script: {script} (looked here, in {ROOT} and in {SCRIPTS})")


def launch(script: str | Path, nproc: int = 1, args=(), *, backend: str = "auto", run_dir=None,
           env: dict | None = None, timeout: float = 600, check: bool = True, torchrun_args=(),
           on_line=None, stop: threading.Event | None = None, quiet: bool = False) -> RunResult:
    """Run ``script`` under torchrun with ``nproc`` processes and stream its output live.

    run_dir: passed to the script as ``--run-dir``; its metrics.json is returned in the result.
    timeout: seconds of wall time before every process is stopped and LaunchError raised.
    check: raise LaunchError (with the failing rank's traceback) when the job fails.
    on_line: called with each output line (default: print); stop: an Event that ends the job.
    """
    chosen = plan(nproc, backend)
    args = list(args)
    if run_dir is not None:
        run_dir = Path(run_dir)
        if not run_dir.is_absolute():
            run_dir = ROOT / run_dir
        args += ["--run-dir", str(run_dir)]
    cmd = torchrun_command(script, nproc, args, torchrun_args)
    job_env = {"OMP_NUM_THREADS": str(chosen.threads_per_rank), **(env or {})}
    if chosen.device == "cpu" and accelerator_count() > 0:
        job_env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on a GPU box: keep every rank on the CPU
    emit = on_line or _print_line
    if not quiet:
        emit(f"[launcher] {nproc} process(es), {chosen.backend} on {chosen.device} ({chosen.reason}); "
             f"{chosen.threads_per_rank} CPU thread(s) per rank\n")
        emit(f"[launcher] $ {_shell_form(cmd)}\n")
    result = run_commands([("", cmd, job_env)], timeout=timeout, on_line=emit, stop=stop)
    result.run_dir = run_dir
    metrics_file = run_dir / "metrics.json" if run_dir else None
    if metrics_file and metrics_file.exists() and metrics_file.stat().st_mtime >= time.time() - result.wall_time - 1:
        result.metrics = json.loads(metrics_file.read_text())
    if not quiet:
        emit(f"[launcher] exit code {result.returncode} after {result.wall_time:.1f} s\n")
    if check and result.returncode != 0:
        raise LaunchError(f"{Path(script).name} failed with exit code {result.returncode}.\n"
                          + root_cause(result.output))
    return result


def run_commands(jobs, *, timeout: float = 600, on_line=None, stop: threading.Event | None = None,
                 cwd: Path = ROOT) -> RunResult:
    """Run several commands at once (e.g. two simulated nodes), merging their output live.

    jobs: list of (label, argv, extra_env); a non-empty label prefixes each of that job's lines.
    Returns when all have exited; on timeout, stop or KeyboardInterrupt every process tree is ended.
    """
    emit = on_line or _print_line
    lines: queue.Queue = queue.Queue()
    procs, captured = [], []
    start = time.monotonic()
    reason = None
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
        open_streams = len(procs)
        while open_streams:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                line = ""
            if line is None:
                open_streams -= 1
            elif line:
                captured.append(line)
                emit(line)
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
            emit(f"[launcher] {reason}: ended {ended} process(es)\n")
    output = "".join(captured)
    codes = [p.returncode for p in procs]
    if reason is not None:
        raise LaunchError(f"job {reason}; every process was ended (its output is above).")
    return RunResult(returncode=next((c for c in codes if c != 0), 0), wall_time=time.monotonic() - start,
                     output=output, returncodes=codes)


def _pump(proc: subprocess.Popen, prefix: str, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put(prefix + line)
    proc.stdout.close()
    proc.wait()
    lines.put(None)


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
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return len(procs)


def root_cause(output: str) -> str:
    """torchrun's 'Root Cause' block (the failing rank's traceback, thanks to @record), else the tail."""
    start = output.find("Root Cause (first observed failure)")
    if start >= 0:
        end = output.find("=" * 20, start)
        return output[start:end if end > 0 else None].rstrip()
    return "\n".join(output.rstrip().splitlines()[-25:])


def _shell_form(cmd: list[str]) -> str:
    shown = ["torchrun", *cmd[3:]] if cmd[1:3] == ["-m", "torch.distributed.run"] else cmd
    return " ".join(shlex.quote(str(Path(c).relative_to(ROOT)) if str(c).startswith(str(ROOT) + "/") else c)
                    for c in shown)


def _print_line(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()
