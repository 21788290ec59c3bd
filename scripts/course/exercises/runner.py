"""The recorder: runs an exercise script under the checker's eyes (started by ``course.exercises``, not by learners).

    torchrun --nproc-per-node=2 scripts/course/exercises/runner.py SCRIPT [ARGS...]

Runs SCRIPT as ``python SCRIPT ARGS`` would (as ``__main__``, its own folder first on ``sys.path``) and
records, per rank, facts that the script cannot fake or forget to report:
- which files it wrote (an audit hook sees every ``open`` for writing and every rename): exactly one
  rank should write a log or a checkpoint;
- every ``torch.distributed`` collective it called, with the time, whether it was asynchronous and, if it
  was, when its handle was first waited on (``wait()`` or ``get_future()``) and whether the script wrote
  into the collective's tensors before that (``touched``: their version counters moved, e.g. a division
  before ``wait()``, a race whose numbers change from run to run);
- when each ``backward()`` started and ended, when each optimizer step ran, and when autograd called each
  hook registered with ``register_post_accumulate_grad_hook`` (``grad_ready``: a gradient is complete), to
  count collectives per step and to see whether communication ran while backward() computed gradients;
- the indices each ``DistributedSampler`` yielded, with its epoch;
- the optimizer-state bytes held by each optimizer.
The record goes to ``$COURSE_EXERCISE_OUT/runner_rank<RANK>.json`` when the script ends (even by an exception).
"""

import atexit
import inspect
import json
import os
import runpy
import sys
import time

OUT = os.path.abspath(os.environ.get("COURSE_EXERCISE_OUT", "."))
RANK = os.environ.get("RANK", "0")
T0 = time.perf_counter()
record = {"rank": int(RANK), "writes": [], "collectives": [], "backward": [], "grad_ready": [], "steps": [],
          "samplers": [], "state_bytes": 0}


def now() -> float:
    return round(time.perf_counter() - T0, 6)


def _written(path) -> None:
    try:
        path = os.path.abspath(os.fsdecode(path))
    except TypeError:  # a file descriptor, not a path
        return
    if path.startswith(OUT + os.sep) and not os.path.basename(path).startswith("runner_rank") \
            and path not in record["writes"]:
        record["writes"].append(path)


def _audit(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2] or 0
        if (mode and any(c in mode for c in "wax+")) or (not mode and flags & (os.O_WRONLY | os.O_RDWR)):
            _written(args[0])
    elif event in ("os.rename", "os.replace") and len(args) >= 2:
        _written(args[1])


def _save_record():
    path = os.path.join(OUT, f"runner_rank{RANK}.json")
    try:
        os.makedirs(OUT, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _tensors(args, kwargs) -> list:
    """The tensors a collective was given (in lists too): the ones it reads and writes."""
    import torch

    found = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


class _Handle:
    """An asynchronous collective's handle (torch's Work), noting when it is first waited on and whether the
    script wrote into the collective's tensors before that: their version counters moved more than the
    collective moves them itself (once for ReduceOp.AVG, which divides in place; never for the others)."""

    def __init__(self, work, entry, versions, own_writes):
        self._work, self._entry, self._versions, self._own = work, entry, versions, own_writes

    def _waited(self):
        if self._entry["waited"] is None:
            self._entry["waited"] = now()
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


def _instrument():
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import DistributedSampler

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
            entry = {"op": name, "t": now(), "async": asynchronous, "waited": None, "touched": None}
            record["collectives"].append(entry)
            versions = [(t, t._version) for t in _tensors(args, kwargs)] if asynchronous else []
            work = fn(*args, **kwargs)
            if not asynchronous or work is None:
                return work
            return _Handle(work, entry, versions, int(given.get("op") == dist.ReduceOp.AVG))
        wrapper.__wrapped__ = fn
        return wrapper

    for name in ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single"):
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))

    save = torch.save  # writes through C++ (no audit event for the file): record its path here

    def recorded_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            _written(f)
        return save(obj, f, *args, **kwargs)

    torch.save = recorded_save

    backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        start = now()
        try:
            return backward(self, *args, **kwargs)
        finally:
            record["backward"].append([start, now()])

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

    torch.Tensor.register_post_accumulate_grad_hook = recorded_register

    sampler_iter = DistributedSampler.__iter__

    def recorded_iter(self):
        indices = list(sampler_iter(self))
        record["samplers"].append({"sampler": id(self), "epoch": self.epoch, "rank": self.rank,
                                   "indices": [int(i) for i in indices]})
        return iter(indices)

    DistributedSampler.__iter__ = recorded_iter


def main():
    script, *script_args = sys.argv[1:]
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as when the script runs by itself
    sys.addaudithook(_audit)
    atexit.register(_save_record)
    _instrument()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
