"""What the recorder adds for the DDP doctor (``COURSE_RECORD_TRAINING=1``): the facts of a training run that
show a data-parallel mistake, recorded per rank for the first ``MAX_STEPS`` optimizer steps.

- ``modules``/``params``: each top-level module with parameters that runs a training forward (grad enabled,
  ``.training``), and a fingerprint (sum, sum of squares) of each of its parameters at its first training
  forward after every optimizer step: replicas must agree across ranks;
- ``forwards``: a fingerprint of each training forward's input: ranks must not train on the same samples;
- ``grads``: each optimizer's gradients just before its step (None: the parameter got no gradient);
- ``losses``: each ``backward()``'s loss, and the constant it was multiplied by on the way (``loss / accum``
  is 1/accum; a GradScaler's scale is taken out);
- ``loaders``: every pass over a ``DataLoader``: the sample indices its sampler gave (the whole pass, as
  drawn at its start), how many batches were taken, whether gradients were on (training) or off (evaluation),
  the sampler's class and ``DistributedSampler`` settings; ``COURSE_RECORD_STEPS=K`` cuts every pass (and the
  loader's length, which scripts use to count their steps) to K batches, so that a long epoch takes seconds,
  while the whole pass is still recorded; with each pass, a fingerprint of the ``Subset`` split it reads
  (``split``) and of a dataset held in tensors (``data``): ranks that split or draw the data each their own way;
- ``ddp``: each DistributedDataParallel's settings, entries into ``no_sync()``, ``Join`` contexts, threads;
  ``ddp_eval``: each forward through DDP without gradients, with the buffers it broadcast and the script's line.
Imported by ``recorder.py`` by its plain name, so that it works beside a learner's own ``course`` package."""

import contextlib
import itertools
import os
import sys

import torch

MAX_STEPS = 40  # fingerprints of the first optimizer steps: enough for every finding, bounded in size
MAX_INDICES = 200_000  # per pass; longer passes keep their length and first indices only
STEPS = int(os.environ.get("COURSE_RECORD_STEPS") or 0)
LOSS_NODES = ("LossBackward0", "MeanBackward0", "MeanBackward1")  # a mean over the batch
state = {"depth": 0, "steps": 0, "last": {}, "names": {}, "scaled": {}, "params": []}
record: dict = {}
now = None


def _fp(t):
    """(sum, sum of squares) of a tensor in float64, or None for a sharded DTensor (not a replica)."""
    t = t.detach()
    if hasattr(t, "placements"):
        if any(p.is_shard() for p in t.placements):
            return None
        t = t.to_local()
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=t.device)
    t = t.flatten()
    return torch.stack([t.sum(dtype=torch.float64), t.float().square().sum(dtype=torch.float64)])


def _fps(tensors) -> list:
    found = [_fp(t) for t in tensors]
    real = [f for f in found if f is not None]
    values = iter(torch.stack(real).tolist()) if real else iter(())
    return [next(values) if f is not None else None for f in found]


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        value = list(value)
    elif isinstance(value, dict):
        value = list(value.values())
    else:
        return None
    for item in value:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _module_key(module) -> int:
    keys = state.setdefault("modules", {})
    if id(module) not in keys:
        record["threads"]["torch"] = torch.get_num_threads()  # as the script set it, not as it started
        named = list(module.named_parameters())
        keys[id(module)] = len(keys)
        for name, p in named:
            state["names"][id(p)] = name.removeprefix("module.").removeprefix("_orig_mod.")
        state["params"].append([p for _, p in named])
        sharded = any(hasattr(p, "placements") and any(pl.is_shard() for pl in p.placements) for _, p in named)
        record["modules"].append({"class": type(module).__name__, "names": [state["names"][id(p)] for _, p in named],
                                  "shapes": [list(p.shape) for _, p in named], "sharded": sharded,
                                  "device": str(named[0][1].device)})
    return keys[id(module)]


def _pre_forward(module, args):
    state["depth"] += 1
    if state["depth"] != 1 or not torch.is_grad_enabled() or not module.training or state["steps"] >= MAX_STEPS:
        return
    if next(module.parameters(), None) is None:  # a loss module: not the model
        return
    key = _module_key(module)
    x = _first_tensor(args)
    record["forwards"].append({"m": key, "step": state["steps"], "t": now(),
                               "shape": list(x.shape) if x is not None else None,
                               "x": _fps([x])[0] if x is not None and x.numel() else None})
    if state["last"].get(key) != state["steps"]:
        state["last"][key] = state["steps"]
        record["params"].append({"m": key, "step": state["steps"], "fp": _fps(list(module.parameters()))})


def _post_forward(module, args, output):
    state["depth"] = max(0, state["depth"] - 1)


def _pre_step(optimizer, args, kwargs):
    """Every gradient of the model(s) just before a step: all of them, not only this optimizer's (a ZeRO-1
    optimizer holds a different share on each rank, while every gradient must still be averaged)."""
    if state["steps"] >= MAX_STEPS:
        return
    params = [p for group in state["params"] for p in group] or \
        [p for group in optimizer.param_groups for p in group["params"]]
    keys = state.setdefault("optimizers", {})
    opt = keys.setdefault(id(optimizer), len(keys))
    names = [state["names"].get(id(p), f"param{i}") for i, p in enumerate(params)]
    grads = _fps([p.grad for p in params if p.grad is not None])
    it = iter(grads)
    record["grads"].append({"opt": opt, "step": state["steps"], "t": now(), "names": names,
                            "fp": [next(it) if p.grad is not None else None for p in params]})


def _post_step(optimizer, args, kwargs):
    state["steps"] += 1


def new_world() -> None:  # a process group made after another: its steps and models counted afresh
    state.update(steps=0, last={}, modules={}, params=[], optimizers={}, scaled={})


def on_backward(loss) -> None:
    """The loss of a backward() call and the constant factor between it and the mean loss below it."""
    if len(record["losses"]) >= 50 * MAX_STEPS:
        return
    factor, node = 1.0, loss.grad_fn
    if id(loss) in state["scaled"]:  # scaler.scale(loss): take the GradScaler's scale out
        factor = 1.0 / state["scaled"].pop(id(loss))
    while node is not None and type(node).__name__ in ("MulBackward0", "DivBackward0"):
        other = getattr(node, "_saved_other", None)
        if not isinstance(other, torch.Tensor) or other.numel() != 1 or getattr(node, "_saved_self", None) is not None:
            break
        value = float(other)
        factor *= value if type(node).__name__ == "MulBackward0" else 1.0 / value
        node = next((n for n, _ in node.next_functions if n is not None), None)
    value = float(loss.detach()) if loss.numel() == 1 else None
    record["losses"].append({"t": now(), "step": state["steps"], "v": value, "f": factor,
                             "root": type(node).__name__ if node is not None else None})


def _split_fp(subset) -> int:
    """A fingerprint of a Subset's indices (once per Subset): equal on every rank that drew the same split."""
    fps = state.setdefault("splits", {})
    if id(subset) not in fps:
        fps[id(subset)] = hash((len(subset.indices), *map(int, subset.indices[:MAX_INDICES])))
    return fps[id(subset)]


def _data_fp(dataset):
    """A fingerprint of a dataset held in tensors (TensorDataset): equal on every rank that built the same data."""
    tensors = getattr(dataset, "tensors", None)
    if not isinstance(tensors, tuple) or not tensors or not isinstance(tensors[0], torch.Tensor):
        return None
    fps = state.setdefault("data", {})
    if id(tensors[0]) not in fps:
        fps[id(tensors[0])] = _fps([tensors[0]])[0]
    return fps[id(tensors[0])]


def _view_fp(dataset):
    """A fingerprint of the index lists a dataset of the script's own holds (a hand-made partition's): ranks whose
    datasets differ there read different parts (hashes of ints only: a str's differs between processes)."""
    fps = state.setdefault("views", {})
    if id(dataset) not in fps:
        found = [(len(v), hash(tuple(v[:MAX_INDICES]))) for _, v in sorted(getattr(dataset, "__dict__", {}).items())
                 if isinstance(v, (list, tuple, range)) and v and all(type(i) is int for i in v[:10])]
        fps[id(dataset)] = hash(tuple(found)) if found else None
    return fps[id(dataset)]


def _samples(entry: dict, batch) -> None:
    """Fingerprints of the samples a training pass drew (its batches' first tensor, row by row; 512 at most)."""
    x = _first_tensor(batch)
    if x is None or x.dim() == 0 or x.numel() == 0 or len(entry["samples"]) >= 512 or not entry["train"]:
        return
    rows = x.detach().reshape(len(x), -1).double()
    entry["samples"] += [hash((round(a, 6), round(b, 6))) for a, b in torch.stack([rows.sum(1), rows.square().sum(1)], 1).tolist()]


def _install_loaders():
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Subset
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    class Recorded:
        """A loader's index sampler whose every pass is drawn whole at its start and recorded."""

        def __init__(self, loader, inner):
            self.loader, self.inner = loader, inner

        def __len__(self):
            return min(len(self.inner), STEPS) if STEPS else len(self.inner)

        def __iter__(self):
            try:
                length = len(self.inner)
            except TypeError:  # no length (an endless sampler): not drawn ahead, not recorded
                return iter(self.inner)
            rest = iter(self.inner)
            items = list(itertools.islice(rest, length))
            sampler = self.inner.sampler if isinstance(self.inner, BatchSampler) else self.inner
            flat = [int(i) for item in items for i in (item if isinstance(item, (list, tuple)) else [item])
                    if isinstance(i, int) or hasattr(i, "__index__")]
            dataset, subset, split = self.loader.dataset, False, []
            while isinstance(dataset, Subset):  # a sample is known by its index in the underlying dataset
                flat = [int(dataset.indices[i]) for i in flat]
                split.append(_split_fp(dataset))
                dataset, subset = dataset.dataset, True
            try:
                size, base = len(self.loader.dataset), len(dataset)  # what one pass covers; the whole set
            except TypeError:
                size = base = None
            dist_sampler = None
            if isinstance(sampler, DistributedSampler):
                dist_sampler = {k: getattr(sampler, k) for k in ("epoch", "seed", "shuffle", "drop_last",
                                                                    "num_replicas", "rank", "total_size")}
            record["loaders"].append({
                "loader": id(self.loader), "dataset": type(dataset).__name__, "size": size, "base": base, "subset": subset,
                "sampler": type(sampler).__name__, "distributed": dist_sampler, "train": torch.is_grad_enabled(),
                "batches": len(items), "consumed": 0, "count": len(flat), "indices": flat[:MAX_INDICES],
                "workers": self.loader.num_workers, "t": now(), "end": None, "step": state["steps"],
                "split": hash(tuple(split)) if split else None, "data": _data_fp(dataset), "samples": [],
                "view": None if subset else _view_fp(dataset)})
            state["pass"] = record["loaders"][-1]
            if STEPS and len(items) > STEPS:  # cut: the pass (and the loader's length) ends after STEPS batches
                record["loaders"][-1]["cut"] = STEPS
                return iter(items[:STEPS])
            return itertools.chain(items, rest)  # a sampler that yields more than its length still does

    index_sampler = DataLoader._index_sampler

    def recorded_index_sampler(loader):
        return Recorded(loader, index_sampler.fget(loader))

    DataLoader._index_sampler = property(recorded_index_sampler)

    loader_iter = DataLoader.__iter__

    def recorded_loader_iter(loader):
        before = len(record["loaders"])
        it = loader_iter(loader)
        # With worker processes torch draws the sampler twice for one pass (the iterator's __init__, then _reset):
        # the pass is the last draw, the one the iterator reads.
        del record["loaders"][before:-1]
        it._course_pass = state.get("pass")
        return it

    DataLoader.__iter__ = recorded_loader_iter

    next_batch = _BaseDataLoaderIter.__next__

    def recorded_next(it):
        entry = getattr(it, "_course_pass", None)
        try:
            batch = next_batch(it)
        except StopIteration:
            if entry is not None:
                entry["end"] = now()
            raise
        if entry is not None:
            entry["consumed"] += 1
            with contextlib.suppress(Exception):  # never the script's error
                _samples(entry, batch)
        return batch

    _BaseDataLoaderIter.__next__ = recorded_next


def _script_line(script: str) -> str:
    """file:line of the script's innermost frame on the stack, or ''."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != script:
        frame = frame.f_back
    return f"{os.path.basename(script)}:{frame.f_lineno}" if frame is not None else ""


def _install_ddp():
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    init = DDP.__init__

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        record["ddp"].append({"find_unused_parameters": bool(self.find_unused_parameters),
                              "static_graph": bool(self.static_graph), "device_ids": self.device_ids,
                              "t": now()})

    DDP.__init__ = recorded_init
    forward = DDP.forward

    def recorded_forward(self, *args, **kwargs):
        if not torch.is_grad_enabled() and len(record["ddp_eval"]) < 200:  # evaluation through the wrapper
            record["ddp_eval"].append({"t": now(), "buffers": int(self.will_sync_module_buffers() and
                                                                  len(self.modules_buffers)),
                                       "where": _script_line(record.get("script", ""))})
        return forward(self, *args, **kwargs)

    DDP.forward = recorded_forward
    no_sync = DDP.no_sync

    def recorded_no_sync(self):
        record["no_sync"] += 1
        return no_sync(self)

    DDP.no_sync = recorded_no_sync
    enter = Join.__enter__

    def recorded_enter(self):
        record["join"] += 1
        return enter(self)

    Join.__enter__ = recorded_enter


def install(rec: dict, clock) -> None:
    """Add the doctor's facts to ``rec`` (the recorder's record), timed with ``clock``."""
    global record, now
    record, now = rec, clock
    rec.update(modules=[], params=[], forwards=[], grads=[], losses=[], loaders=[], ddp=[], ddp_eval=[],
               no_sync=0, join=0,
               threads={"torch": torch.get_num_threads(), "cpus": os.cpu_count()}, max_steps=MAX_STEPS,
               steps_per_pass=STEPS)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    torch.nn.modules.module.register_module_forward_pre_hook(_pre_forward)
    torch.nn.modules.module.register_module_forward_hook(_post_forward, always_call=True)
    register_optimizer_step_pre_hook(_pre_step)
    register_optimizer_step_post_hook(_post_step)
    scale = torch.amp.GradScaler.scale

    def recorded_scale(self, outputs):
        scaled = scale(self, outputs)
        if isinstance(scaled, torch.Tensor) and self.is_enabled():
            state["scaled"][id(scaled)] = float(self.get_scale())
        return scaled

    torch.amp.GradScaler.scale = recorded_scale
    _install_loaders()
    _install_ddp()
