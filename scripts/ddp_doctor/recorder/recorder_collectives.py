"""The recorder's view of ``torch.distributed`` (used by ``recorder.py``, imported by its plain name): every
collective called from Python, ``init_process_group``, and the flight recorder's entries (``flight_recorder``).

Per collective: its time, its line in the script, whether torch itself called it (DDP's, Join's, FSDP's own),
whether it ran inside a forward pass, its error if it raised, and for an asynchronous one when its handle was
first waited on (``wait()`` or ``get_future()``) and whether the script wrote into the collective's tensors
before that (``touched``: their version counters moved, e.g. a division before ``wait()``, a race).
``init_process_group``: where it was called, the rank and world size given by hand, what it ended with; with
a timeout set, the script's own timeout is replaced by it (a hang then ends in seconds). A rendezvous port the
script sets itself is replaced: under torchrun a ``MASTER_PORT`` by torchrun's own (its store listens there), a
``tcp://host:port`` by the port given (one known free), as is ``MASTER_PORT`` without torchrun. A busy
port ends in one line that says so. A collective that times out asks every rank where it is (``dump-now``), so
that a rank stuck outside any collective is named as soon as the hang is seen; every rank's ``watch`` answers.
"""

import glob
import inspect
import os
import re
import sys
import time

NAMES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
         "all_gather_object", "broadcast_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
         "monitored_barrier")


def flight_recorder(limit: int = 2000) -> list[dict]:
    """The process group's flight-recorder entries (torch records gloo and nccl collectives alike)."""
    try:
        import pickle

        import torch

        # Without stack traces: none is kept, and symbolizing them imported torch._dynamo and torch._inductor
        # (about 1.4 s of CPU in every rank, at its exit).
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True,
                                                                      includeStackTraces=False))
    except Exception:  # noqa: BLE001 - no process group, or a build without it: nothing to add
        return []
    keep = ("profiling_name", "collective_seq_id", "p2p_seq_id", "time_created_ns", "input_sizes", "state",
            "process_group", "is_p2p")
    return [{k: e.get(k) for k in keep} for e in dump.get("entries", [])[-limit:]]


def _tensors(args, kwargs) -> list:
    """The tensors a collective was given (in lists too): the ones it reads and writes."""
    import torch

    found = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


class Handle:
    """An asynchronous collective's handle (torch's Work), noting when it is first waited on and whether the
    script wrote into the collective's tensors before that: their version counters moved more than the
    collective moves them itself (once for ReduceOp.AVG, which divides in place; never for the others)."""

    def __init__(self, work, entry, versions, own_writes, now):
        self._work, self._entry, self._versions, self._own, self._now = work, entry, versions, own_writes, now

    def _waited(self):
        if self._entry["waited"] is None:
            self._entry["waited"] = self._now()
            self._entry["touched"] = any(t._version - v > self._own for t, v in self._versions)

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._waited()
        return result

    def get_future(self):
        self._waited()  # a future's wait() is the learner's; counted as waited when it is asked for
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


def on_error(error: BaseException, out: str) -> None:
    """A collective that failed: this rank is on its way out (``leaving``). A wait that timed out (a hang): every
    rank writes where it is (recorder.py's watcher). This rank stays until they have, or had ended (10 s at most):
    once it exits, torchrun ends the others, and on a loaded machine a watcher that polls every 0.25 s could be
    ended before it wrote."""
    global leaving
    leaving = True
    if "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower():
        try:
            open(os.path.join(out, "dump-now"), "a").close()
        except OSError:
            return
        world, deadline = int(os.environ.get("WORLD_SIZE") or 1), time.monotonic() + 10
        while time.monotonic() < deadline and len(_said(out)) < world:
            time.sleep(0.1)


leaving = False  # a collective of this rank failed: it is on its way out


def watch(recorder, main_ident: int) -> None:
    """Until the process ends: when ``dump-now`` appears, say where the main thread is (a hang): the record so far,
    then ``stuck_<name>.json`` (last: once it is there, so is the record); a rank whose script has ended writes its
    last record instead. ``recorder``: the recorder's module (its record, its name for this process)."""
    trigger = os.path.join(recorder.OUT, "dump-now")
    while not os.path.exists(trigger):
        time.sleep(0.25)
    if recorder.FINISHED:  # the process is on its way out: its record is its last
        recorder._save_record(True)
        return
    frame, stack = sys._current_frames().get(main_ident), []
    while frame is not None:
        stack.append({"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": frame.f_code.co_name})
        frame = frame.f_back
    stuck = {"rank": int(recorder.rank()), "stack": stack[::-1], "current": recorder.record.get("current"),
             "fr": flight_recorder(50), "t": recorder.now(), "leaving": leaving}
    for _ in range(3):  # the job is about to be stopped, before atexit could run: save what was recorded
        try:
            recorder._save_record()
            break
        except RuntimeError:  # the main thread changed the record meanwhile (it was not stuck): again
            time.sleep(0.05)
    recorder._save(f"stuck_{recorder._name()}.json", stuck)


def _said(out: str) -> set:
    """The ranks that said where they are, or had ended (their last record)."""
    files = glob.glob(os.path.join(out, "stuck_rank*.json")) + glob.glob(os.path.join(out, "record_rank*.json"))
    return {os.path.basename(f).split("rank", 1)[1] for f in files}


# What one world (one process group, from init_process_group to the next) did: a second group made after the
# first starts them afresh and keeps the first's in ``worlds``, so that each world is checked on its own and no rule
# compares records of different worlds (issue 54 item 4).
WORLD_KEYS = ("collectives", "backward", "grad_ready", "steps", "samplers", "modules", "params", "forwards", "grads",
              "losses", "loaders", "ddp", "ddp_eval", "no_sync", "join")


def _new_world(record: dict, reset=None) -> None:
    """The world so far moved to ``worlds``; its facts emptied (``reset``: the training recorder's too)."""
    record.setdefault("worlds", []).append({"pg": record.get("pg") or {},
                                            "facts": {k: record[k] for k in WORLD_KEYS if isinstance(record.get(k), list)}})
    for key in WORLD_KEYS:
        if isinstance(record.get(key), list):
            record[key] = []
    record["state_bytes"] = 0
    if reset:
        reset()


def install(record: dict, now, where, pg_timeout: float = 0.0, depth=None, port: int = 0, out: str = "",
            new_world=None) -> None:
    """Wrap torch.distributed's collectives and init_process_group; ``depth()``: how deep in forward calls;
    ``new_world()``: called when a process group is made after another was (the training recorder's reset)."""
    import torch
    import torch.distributed as dist

    torch_dir = os.path.dirname(torch.__file__) + os.sep

    def counted(name, fn):
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None

        def wrapper(*args, **kwargs):
            try:
                given = signature.bind(*args, **kwargs).arguments if signature else kwargs
            except TypeError:
                given = kwargs
            asynchronous = bool(given.get("async_op"))
            internal = sys._getframe(1).f_code.co_filename.startswith(torch_dir)
            entry = {"op": name, "t": now(), "async": asynchronous, "waited": None, "touched": None,
                     "where": where(), "internal": internal}
            if depth is not None:
                entry["in_forward"] = depth() > 0
            record["collectives"].append(entry)
            record["current"] = entry
            versions = [(t, t._version) for t in _tensors(args, kwargs)] if asynchronous else []
            try:
                work = fn(*args, **kwargs)
            except Exception as error:
                entry["error"] = str(error)[:300]
                if out:
                    on_error(error, out)
                raise
            record["current"] = None
            if not asynchronous or work is None or internal:  # torch's own callers hand the handle to C++
                return work
            return Handle(work, entry, versions, int(given.get("op") == dist.ReduceOp.AVG), now)
        wrapper.__wrapped__ = fn
        return wrapper

    for name in NAMES:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))

    init = dist.init_process_group
    init_params = inspect.signature(init)
    launched = os.environ.get("MASTER_PORT") if os.environ.get("TORCHELASTIC_RUN_ID") else None

    def recorded_init(*args, **kwargs):
        asked = dict(kwargs)
        if pg_timeout:
            from datetime import timedelta

            kwargs["timeout"] = timedelta(seconds=pg_timeout)
        given = init_params.bind_partial(*args, **kwargs).arguments
        method = given.get("init_method")
        if launched and os.environ.get("MASTER_PORT") != launched:  # torchrun's store listens there, not elsewhere
            os.environ["MASTER_PORT"] = launched
        if port:
            if os.environ.get("MASTER_PORT") and not launched:
                os.environ["MASTER_PORT"] = str(port)
            if isinstance(method, str) and method.startswith("tcp://"):
                given["init_method"] = method = re.sub(r":\d+(?=$|[/?])", f":{port}", method, count=1)
        if (record.get("pg") or {}).get("world_size") is not None:  # a world was made before this one
            _new_world(record, new_world)
        record["pg"] = {"where": where(), "rank_arg": asked.get("rank"), "world_size_arg": asked.get("world_size")}
        try:
            result = init(**given)
        except Exception as error:
            if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
                shown = method if isinstance(method, str) and method.startswith("tcp://") else \
                    f"MASTER_PORT={os.environ.get('MASTER_PORT')}"
                raise RuntimeError(f"the rendezvous port is busy ({shown}): another program, or another run of "
                                   "this script, uses it; stop it or choose another port") from None
            raise
        record["pg"].update(backend=str(dist.get_backend()), rank=dist.get_rank(), world_size=dist.get_world_size())
        return result

    recorded_init.__wrapped__ = init
    dist.init_process_group = recorded_init
