"""The recorder: runs a training script under torchrun and records, per rank, what it did (used by the
exercise checker and by the DDP doctor; not started by learners).

    torchrun --nproc-per-node=2 scripts/ddp_doctor/recorder/recorder.py SCRIPT [ARGS...]

Runs SCRIPT as ``python SCRIPT ARGS`` would (as ``__main__``, its own folder first on ``sys.path``), recording:
- the files it wrote (an audit hook sees every ``open`` for writing and every rename; ``torch.save`` too), and
  the files written during the run that it read;
- every ``torch.distributed`` collective it called from Python, and ``init_process_group``
  (``recorder_collectives.py``); at exit the flight recorder's entries: every collective the process group
  ran, DDP's own gradient all-reduces included;
- when each ``backward()`` started and ended, each optimizer step, each ``register_post_accumulate_grad_hook``
  call (``grad_ready``), the optimizer-state bytes, the indices each ``DistributedSampler`` yielded;
- with ``COURSE_RECORD_TRAINING=1`` (the doctor), ``recorder_training.py``'s facts and ``recorder_sites.py``'s.

Launch styles: under torchrun, one recorder per rank; with ``COURSE_RECORD_LAUNCH=spawn``, ``python recorder.py
SCRIPT`` runs a script that starts its own processes once, each recorded (``recorder_spawn.py``; the parent's own
writes in ``record_parent.json``). ``COURSE_RECORD_STANDIN=1``: the CPU stand-in for CUDA and NCCL;
``COURSE_RECORD_LOCAL_RANK_ARG``: the script gets ``--local_rank=N``, as ``torch.distributed.launch`` gave it.

Settings (environment): ``COURSE_RECORD_OUT``, the folder of the records (``record_rank<RANK>.json``, written
when the script ends, even by an exception; never half-written); ``COURSE_RECORD_PG_TIMEOUT``, seconds that
replace the script's process-group timeout (a hang then ends in seconds); ``COURSE_RECORD_PROTECT=1``: a file the
script overwrites (one older than ``COURSE_RECORD_SINCE``) is copied first, for the caller to restore. ``dump-now``
appearing in the out folder makes every rank write its record so far, then ``stuck_rank<RANK>.json``: where its
main thread is, its last collectives, ``leaving`` if a collective failed; a rank past its script, its last record.
"""

import atexit
import contextlib
import hashlib
import json
import os
import runpy
import shutil
import sys
import threading
import time

OUT = os.path.abspath(os.environ.get("COURSE_RECORD_OUT") or ".")
RANK = os.environ.get("RANK", "0")
LAUNCH = os.environ.get("COURSE_RECORD_LAUNCH", "")
STANDIN = os.environ.get("COURSE_RECORD_STANDIN", "0") not in ("", "0")
TRAINING = os.environ.get("COURSE_RECORD_TRAINING", "0") not in ("", "0")
PROTECT = os.environ.get("COURSE_RECORD_PROTECT", "0") not in ("", "0")
PG_TIMEOUT = float(os.environ.get("COURSE_RECORD_PG_TIMEOUT") or 0)
SINCE = float(os.environ.get("COURSE_RECORD_SINCE") or 0)  # when the job started: older files were there before
SCRIPT = os.path.abspath(os.environ.get("COURSE_RECORD_SCRIPT") or (sys.argv[1] if len(sys.argv) > 1 else ""))
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the doctor's own code: not the script
# Writes there are the libraries' own (devices, caches, compiled kernels, torchrun's logs), not the script's.
IGNORED = tuple(os.path.realpath(p) + os.sep for p in {"/dev", "/proc", "/sys", os.path.expanduser("~/.cache"),
                                                        sys.prefix, sys.base_prefix})
IGNORED_PARTS = ("/torchinductor_", "/triton", "/course-torchrun-", "__pycache__", "/matplotlib")
T0 = time.perf_counter()
record = {"rank": int(RANK), "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                     "LOCAL_WORLD_SIZE", "GROUP_RANK")},
          "writes": [], "reads": [], "created": [], "protected": {}, "collectives": [], "backward": [], "grad_ready": [], "steps": [],
          "samplers": [], "state_bytes": 0, "pg": None, "fr": [], "script": SCRIPT, "dirs": [], "errors": [],
          "t0_ns": time.time_ns(), "pid": os.getpid(), "sites": {}}
_LOCK = threading.Lock()  # one writer of the record at a time: the main thread at exit, or the watcher


def now() -> float:
    return round(time.perf_counter() - T0, 6)


def where(limit: int = 40) -> str:
    """'file:line' of the innermost frame of the script itself (or of any file outside the libraries)."""
    frame, fallback = sys._getframe(1), ""
    for _ in range(limit):
        if frame is None:
            break
        name = frame.f_code.co_filename
        if name == SCRIPT:
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        if not fallback and not name.startswith((HERE, sys.prefix, "<")) and "site-packages" not in name:
            fallback = f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback


def _mine(path: str) -> bool:
    """Whether a write counts: inside OUT for the checker's scripts; anywhere but caches for the doctor's."""
    if TRAINING:
        return not (path.startswith(IGNORED) or path.startswith(OUT + os.sep) or any(p in path for p in IGNORED_PARTS))
    return path.startswith(OUT + os.sep) and not os.path.basename(path).startswith(("record_", "stuck_rank"))


def _protect(path: str) -> None:
    """Copy an existing file before the script overwrites it (once, whichever rank gets there first)."""
    key = hashlib.sha1(path.encode()).hexdigest()[:16]
    saved = os.path.join(OUT, "protected", key)
    try:
        os.makedirs(os.path.dirname(saved), exist_ok=True)
        fd = os.open(saved + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another rank copies it: wait until its copy is complete
        deadline = time.monotonic() + 30
        while not os.path.exists(saved) and time.monotonic() < deadline:
            time.sleep(0.01)
        return
    except OSError:
        return
    os.close(fd)
    shutil.copy2(path, saved + ".tmp")
    with open(saved + ".path", "w") as f:
        f.write(path)
    os.replace(saved + ".tmp", saved)
    record["protected"][path] = saved


def _written(path) -> None:
    try:
        path = os.path.abspath(os.fsdecode(path))
    except TypeError:  # a file descriptor, not a path
        return
    if path in record["writes"] or not _mine(path):
        return
    if TRAINING:
        try:
            older = os.stat(path).st_mtime < SINCE
        except OSError:
            older = False
        if older and os.path.isfile(path):
            if PROTECT and path not in record["protected"]:
                _protect(path)
        elif path not in record["created"]:
            record["created"].append(path)
        record["sites"][path] = recorder_sites.frames(SCRIPT)  # the script's lines that wrote it
    record["writes"].append(path)


def _removed(path, dir_fd) -> None:
    """A file the script deletes (or renames away) that was there before the run: copied first, to be restored."""
    if not PROTECT or not isinstance(path, (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(path)
    if dir_fd not in (None, -1):  # relative to an open folder (shutil.rmtree)
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return
    path = os.path.abspath(path)
    try:
        older = os.path.isfile(path) and os.stat(path).st_mtime < SINCE
    except OSError:
        return
    if older and _mine(path) and path not in record["protected"]:
        _protect(path)


def _audit(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2] or 0
        if (mode and any(c in mode for c in "wax+")) or (not mode and flags & (os.O_WRONLY | os.O_RDWR)):
            _written(args[0])
        elif TRAINING and len(record["reads"]) < 100:  # a file this run wrote, read back: a hand-off between ranks?
            path = os.path.abspath(os.fsdecode(args[0]))
            with contextlib.suppress(OSError):  # an error here would be the script's open()'s
                if path not in record["reads"] and _mine(path) and os.stat(path).st_mtime >= SINCE:
                    record["reads"].append(path)
    elif event in ("os.rename", "os.replace") and len(args) >= 2:
        _removed(args[0], args[2] if len(args) > 2 else None)
        _written(args[1])
    elif event == "os.remove" and TRAINING and args:
        _removed(args[0], args[1] if len(args) > 1 else None)
    elif event == "os.mkdir" and TRAINING and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if _mine(path) and not os.path.exists(path):
            record["dirs"].append(path)


def _save(name: str, data: dict) -> None:
    path = os.path.join(OUT, name)
    try:
        os.makedirs(OUT, exist_ok=True)
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"  # each writer its own: never two in one file
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        pass


def rank() -> str:
    """This process's rank: its process group's, else its place among those the script started, else RANK."""
    pg = record.get("pg") or {}
    if "rank" in pg:
        return str(pg["rank"])
    return str(record["spawn_index"]) if CHILD and record.get("spawn_index") is not None else RANK


def _name() -> str:  # JOB: a later mp.spawn's world (recorder_spawn), under names of its own
    return "parent" if LAUNCH == "spawn" and not CHILD else f"job{JOB}_rank{rank()}" if JOB else f"rank{rank()}"


def _save_record(ended: bool = False):
    """Write the record (``ended``: the process's last one, at its exit; else a hang's dump, the rank going on,
    never over the last one)."""
    global _FINAL
    with _LOCK:
        if _FINAL and not ended:
            return
        _FINAL = _FINAL or ended
        record.update(ended=ended, fr=recorder_collectives.flight_recorder(), seconds=now(), rank=int(rank()))
        pg = record.get("pg") or {}
        if CHILD and "rank" in pg:  # a spawned process: one node, its environment as torchrun would have set it
            record["env"] = {"RANK": str(pg["rank"]), "WORLD_SIZE": str(pg["world_size"]),
                             "LOCAL_RANK": str(record.get("spawn_index", pg["rank"])),
                             "LOCAL_WORLD_SIZE": str(pg["world_size"]), "GROUP_RANK": "0"}
        _save(f"record_{_name()}.json", json.loads(json.dumps(record)))  # a copy first: the main thread may go on


def _instrument():
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import DistributedSampler

    recorder_collectives.install(record, now, where, PG_TIMEOUT,
                                 depth=(lambda: training.state["depth"]) if TRAINING else None,
                                 port=int(os.environ.get("COURSE_RECORD_PORT") or 0), out=OUT,
                                 new_world=(lambda: training.new_world()) if TRAINING else None)

    save = torch.save  # writes through C++ (no audit event for the file): record its path here

    def recorded_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            _written(f)
        return save(obj, f, *args, **kwargs)

    torch.save = recorded_save

    backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        start = now()
        if TRAINING:
            training.on_backward(self)
        try:
            return backward(self, *args, **kwargs)
        except Exception as error:
            record["errors"].append({"in": "backward", "where": where(), "error": str(error)[:300]})
            recorder_collectives.on_error(error, OUT)
            raise
        finally:
            record["backward"].append([start, now()])

    timed_backward.__recorder__ = backward  # the stand-in's mode calls the original: recorded once
    torch.Tensor.backward = timed_backward

    def after_step(optimizer, args, kwargs):
        record["steps"].append(now())
        size = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor))
        record["state_bytes"] = max(record["state_bytes"], size)

    register_optimizer_step_post_hook(after_step)

    register_hook = torch.Tensor.register_post_accumulate_grad_hook

    def recorded_register(self, hook):
        def ready(*args, **kwargs):  # called by autograd during backward(): one more gradient complete
            record["grad_ready"].append(now())
            return hook(*args, **kwargs)
        return register_hook(self, ready)

    recorded_register.__recorder__ = register_hook
    torch.Tensor.register_post_accumulate_grad_hook = recorded_register

    sampler_iter = DistributedSampler.__iter__

    def recorded_iter(self):
        indices = list(sampler_iter(self))
        record["samplers"].append({"sampler": id(self), "epoch": self.epoch, "rank": self.rank,
                                   "indices": [int(i) for i in indices]})
        return iter(indices)

    DistributedSampler.__iter__ = recorded_iter


def _start() -> None:
    """Install everything in this process (once): the recorder's siblings, the watcher, the wrappers, the hook."""
    global training, recorder_collectives, recorder_sites, _STARTED
    import recorder_collectives  # this file's folder is on sys.path here: its siblings import by name

    if STANDIN:  # first: the others' wrappers wrap its own
        import recorder_standin

        gpus = int(os.environ.get("COURSE_RECORD_GPUS") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
        recorder_standin.install(record, where, os.environ.get("COURSE_RECORD_PRETEND") == "1", gpus)
    if TRAINING:
        import recorder_sites
        import recorder_training as training

        training.install(record, now)
    threading.Thread(target=recorder_collectives.watch, args=(sys.modules[__name__], threading.main_thread().ident),
                     daemon=True).start()
    _instrument()
    # After torch is imported: importing it under the hook (every module's file opened and compiled is an event,
    # each a Python call) cost each rank about 0.2 s of CPU; the script's own writes come later.
    sys.addaudithook(_audit)
    _STARTED = True


def _script_error(error: BaseException) -> None:
    if not (isinstance(error, SystemExit) and error.code in (0, None)):
        import traceback

        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == SCRIPT]
        entry = {"in": "script", "t": now(), "error": f"{type(error).__name__}: {error}"[:300],
                 "where": f"{os.path.basename(SCRIPT)}:{frames[-1].lineno}" if frames else "",
                 "code": frames[-1].line if frames else ""}
        import recorder_failing_line  # what the names on the failing line held: the checker's first hint reads them

        recorder_failing_line.add_reading(entry, error, SCRIPT)
        record["errors"].append(entry)


def main():
    script, *script_args = sys.argv[1:]
    flag = os.environ.get("COURSE_RECORD_LOCAL_RANK_ARG")
    if flag:  # as torch.distributed.launch called the script
        script_args.append(f"{flag}={os.environ.get('LOCAL_RANK', '0')}")
    sys.argv = [script, *script_args]
    os.environ["COURSE_RECORD_SCRIPT"] = SCRIPT  # for the processes the script starts
    here = sys.path[0]
    _start()
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as when the script runs by itself
    sys.path.append(here)  # a spawned process unpickles its target from ``recorder_spawn``
    import recorder_spawn

    recorder_spawn.install() if LAUNCH == "spawn" else recorder_spawn.guard()  # never two worlds at once
    atexit.register(_save_record, True)
    global FINISHED
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as error:
        _script_error(error)
        raise
    finally:
        FINISHED = True


training = recorder_collectives = recorder_sites = None
CHILD = _STARTED = FINISHED = _FINAL = False
JOB = 0

if __name__ == "__main__":
    import recorder  # this file under its own name: one module, the same in a forked process and recorder_spawn

    recorder.main()
