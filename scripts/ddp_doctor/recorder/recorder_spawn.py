"""The recorder in the processes a script starts itself (used by ``recorder.py`` with
``COURSE_RECORD_LAUNCH=spawn``, imported by its plain name): the script runs once, as its author runs it, and
every process it starts (``torch.multiprocessing.spawn``/``start_processes`` start theirs through
``multiprocessing.Process`` too) runs its target under ``child``: recorded as a rank, whose number comes from its
process group. A DataLoader's worker processes are left alone.

Under torchrun (``guard``), a rank that starts processes of its own (``mp.spawn`` reached through code the doctor
did not read, such as a helper module) would make a second world inside the first: the rank ends at once instead,
its record saying so (``errors``: ``in: "spawn"``), and the doctor runs the script again, once, as its author does.
"""

import functools
import os
import sys
import threading
import time

import recorder


def install() -> None:
    """Every ``multiprocessing.Process`` the script creates from now on runs its target under ``child``."""
    import multiprocessing.process

    init = multiprocessing.process.BaseProcess.__init__
    started = set()  # the process indices torch's spawn started in this job

    def recorded(self, group=None, target=None, name=None, args=(), kwargs=None, *, daemon=None):
        if target is not None and not getattr(target, "__module__", "").startswith("torch.utils.data"):
            spawned = (getattr(target, "__module__", ""), getattr(target, "__name__", "")) == \
                ("torch.multiprocessing.spawn", "_wrap")
            if spawned and args:  # an index started again: a later mp.spawn, a world of its own
                if args[1] in started:
                    started.clear()
                    recorder.record["spawn_jobs"] = recorder.record.get("spawn_jobs", 1) + 1
                started.add(args[1])
            job = recorder.record.get("spawn_jobs", 1) - 1
            target = functools.partial(child, target) if not job else functools.partial(_later, job, target)
        init(self, group, target, name, args, kwargs or {}, daemon=daemon)

    multiprocessing.process.BaseProcess.__init__ = recorded


SPAWN_UNDER_TORCHRUN = "starts its own processes"


def guard() -> None:
    """Under torchrun: a rank whose script starts a process running the script's own function (``mp.spawn``,
    ``start_processes``, ``multiprocessing.Process(target=...)``) ends before that process exists."""
    import multiprocessing.process

    start = multiprocessing.process.BaseProcess.start

    def guarded(self):
        target = getattr(self, "_target", None)
        fn = target
        while isinstance(fn, functools.partial):
            fn = fn.func
        from torch.multiprocessing.spawn import _wrap

        if fn is _wrap or getattr(fn, "__module__", "") in ("__main__", "__mp_main__"):
            recorder.record["errors"].append({"in": "spawn", "t": recorder.now(), "where": recorder.where(),
                                              "error": SPAWN_UNDER_TORCHRUN})
            recorder._save_record(ended=True)
            print(f"recorder: the script {SPAWN_UNDER_TORCHRUN} ({recorder.where()}): this rank ends before "
                  "they start", file=sys.stderr, flush=True)
            os._exit(3)
        return start(self)

    multiprocessing.process.BaseProcess.start = guarded


def _later(job, target, *args, **kwargs):
    """A process of the script's ``job``-th later ``mp.spawn`` (0 is the first): recorded under names of their own
    (``record_job<N>_rank<R>.json``), so that they do not replace the first world's records."""
    recorder.JOB = job
    return child(target, *args, **kwargs)


def child(target, *args, **kwargs):
    """A process the script started: record it as a rank, from a fresh record (a forked copy of the parent's
    is emptied), with the wrapped functions in place of those the script imported by name before."""
    recorder.CHILD = True
    recorder._LOCK = threading.Lock()  # a forked copy of the parent's may be held by a thread that is not here
    record = recorder.record
    if recorder._STARTED:  # forked: the wrappers are there; the record is the parent's
        for value in record.values():
            if isinstance(value, (list, dict)):
                value.clear()
        record.update(pg=None, state_bytes=0, t0_ns=time.time_ns())
        threading.Thread(target=recorder.recorder_collectives.watch, args=(recorder, threading.main_thread().ident),
                         daemon=True).start()
    else:
        recorder._start()
    from torch.multiprocessing.spawn import _wrap

    _rebind_main(args[0] if target is _wrap and args else target)

    try:
        if target is _wrap:  # torch's spawn: _wrap(fn, i, args, error_file) catches fn's error itself
            fn, index, *rest = args
            record["spawn_index"] = index
            return target(functools.partial(_as_rank, fn), index, *rest, **kwargs)
        return _as_rank(target, *args, **kwargs)
    finally:
        recorder.FINISHED = True
        recorder._save_record(ended=True)


def _as_rank(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException as error:
        recorder._script_error(error)
        raise


def _rebind_main(fn) -> None:
    """The script's module was imported again in this process before the wrappers were installed: names it
    took with ``from torch.distributed import init_process_group`` get the wrappers (torch's function by that
    name in ``torch.distributed``, ``torch.cuda`` or ``torch`` that is now the recorder's), in the module and in
    the globals of the function the process runs (runpy ran the script in a namespace of its own)."""
    import types

    import torch
    import torch.distributed as dist

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    while isinstance(fn, functools.partial):
        fn = fn.func
    spaces = [vars(m) for m in (sys.modules.get("__mp_main__"), sys.modules.get("__main__")) if m]
    spaces.append(getattr(fn, "__globals__", {}))
    for space in {id(d): d for d in spaces}.values():
        for name, value in list(space.items()):
            if type(value) is not types.FunctionType or not (value.__module__ or "").startswith("torch"):
                continue
            for owner in (dist, torch.cuda, torch):
                now = vars(owner).get(value.__name__)
                if type(now) is types.FunctionType and now is not value \
                        and not now.__code__.co_filename.startswith(torch_dir):  # a wrapper (functools.wraps: no __module__)
                    space[name] = now
                    break
