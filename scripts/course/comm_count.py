"""Count the collectives a piece of code runs, and their bytes, on this rank (notebook 10); and predict them.

    from course.comm_count import CollectiveCounter
    counter = CollectiveCounter()
    with counter.phase("forward"):
        logits = model(x)
    with counter.phase("backward"):
        loss.backward()
    counter.summary()      # {"forward": {"all-reduce": [calls, bytes]}, "backward": {...}}

A ``TorchDispatchMode`` sees every collective that goes through PyTorch's dispatcher: DTensor's
(functional collectives, ``_c10d_functional.*``) and plain ``torch.distributed`` calls (``c10d.*_``)
alike, in the forward and in the backward (the autograd engine runs under the same mode). The bytes
counted are those of the whole tensor the collective produces or reduces (all-reduce: the tensor;
all-gather: the gathered output; reduce-scatter: the input before scattering): the size the
formulas of the notebook use. Each record also keeps the process group it ran on (``groups``), so that
``summary(group=...)`` gives one mesh dimension's share (notebook 12: ``mesh.get_group("shard").group_name``);
an all-gather's output is its input times that group's size. ``bytes_sent`` turns them into what one rank sends in a ring (``course.sharding.SENT``).
``predict_block`` and ``predict_tp_step`` give the formulas' prediction for the small GPT, to set beside
the count (``same_counts``; ``compare`` prints them side by side).
"""

from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from course.sharding import SENT

# op name in the dispatcher -> (kind, which tensor is the whole one: 1 the first tensor argument, "group" the
# first times the group's size (an all-gather's input), "second" the second (c10d ops: output, then input))
_KINDS = {
    "all_reduce": ("all-reduce", 1), "allreduce_": ("all-reduce", 1),
    "all_gather_into_tensor": ("all-gather", "group"), "_allgather_base_": ("all-gather", 1),
    "allgather_": ("all-gather", "group"),
    "reduce_scatter_tensor": ("reduce-scatter", 1), "_reduce_scatter_base_": ("reduce-scatter", "second"),
    "broadcast": ("broadcast", 1), "broadcast_": ("broadcast", 1),
    "all_to_all_single": ("all-to-all", 1), "alltoall_base_": ("all-to-all", "second"),
}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_c10d_functional_autograd")


def _group(args) -> tuple[str | None, int | None]:
    """(name, size) of the process group a collective runs on, read from its arguments: plain c10d ops carry
    the group itself, functional collectives its name. (None, None) when neither is there."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().name().endswith("ProcessGroup"):
            group = dist.ProcessGroup.unbox(a)
            return group.group_name, group.size()
    names = [a for a in args if isinstance(a, str)]
    if names:
        group = _resolve_process_group(names[-1])
        return group.group_name, group.size()
    return None, None


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


class CollectiveCounter(TorchDispatchMode):
    """Records (phase, kind, bytes) for each collective dispatched while a phase is open."""

    def __init__(self, world_size: int | None = None):
        super().__init__()
        import torch.distributed as dist

        self.world_size = world_size or dist.get_world_size()
        self.records: list[tuple[str, str, int]] = []
        self.groups: list[str | None] = []  # the process group's name of each record
        self._phase = None

    @contextmanager
    def phase(self, name: str):
        self._phase = name
        with self:
            yield self
        self._phase = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._phase is not None and DTensor in types:
            # Let DTensor run the op with this mode still active: the collectives it issues inside
            # (a Partial sum made whole, loss_parallel's reductions) then come through here too.
            return NotImplemented
        ns, _, rest = func.name().partition("::")
        op = rest.split(".")[0]
        if ns in _NAMESPACES and op in _KINDS and self._phase is not None:
            kind, factor = _KINDS[op]
            t = _first_tensor(args[1:] if factor == "second" else args)
            if t is not None:
                size = t.numel() * t.element_size()
                name, group_size = _group(args)
                self.records.append((self._phase, kind, size * ((group_size or self.world_size) if factor == "group"
                                                                else 1)))
                self.groups.append(name)
        return func(*args, **kwargs)

    def summary(self, group: str | None = None) -> dict:
        """{phase: {kind: [calls, bytes]}}, phases and kinds in the order first seen; with ``group`` (a process
        group's name) only the collectives that ran on that group."""
        out: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        for (phase, kind, size), name in zip(self.records, self.groups):
            if group is not None and name != group:
                continue
            out[phase][kind][0] += 1
            out[phase][kind][1] += size
        return {p: {k: list(v) for k, v in kinds.items()} for p, kinds in out.items()}

    def sizes(self, phase: str, kind: str) -> list[int]:
        return [s for p, k, s in self.records if p == phase and k == kind]


def bytes_sent(summary: dict, world_size: int) -> float:
    """What one rank sends for all the collectives of a ``summary()`` phase, in rings (``sharding.SENT``)."""
    return sum(SENT.get(kind, lambda b, n: b)(size, world_size) for kind, (_, size) in summary.items())


def predict_block(tokens: int, width: int, sequence_parallel: bool, column_inputs: int = 4,
                  bytes_per: int = 4) -> dict:
    """One transformer block's collectives in one training step, from the column/row formulas.

    One activation is A = tokens x width x bytes_per bytes (tokens: batch x sequence).
    Without sequence parallelism: forward, one all-reduce of A after each row-parallel layer (attention's
    proj and the MLP's proj); backward, one all-reduce of A for the input gradient of each column-parallel
    layer whose input comes in separately (``column_inputs``: q, k, v and fc are 4; a fused qkv would be 2).
    With it: forward, an all-gather of A into attention and into the MLP and a reduce-scatter of A out
    of each proj; backward, the mirror image (the backward of an all-gather is a reduce-scatter).
    """
    a = tokens * width * bytes_per
    if not sequence_parallel:
        return {"forward": {"all-reduce": [2, 2 * a]}, "backward": {"all-reduce": [column_inputs, column_inputs * a]}}
    both = {"all-gather": [2, 2 * a], "reduce-scatter": [2, 2 * a]}
    return {"forward": dict(both), "backward": dict(both)}


def predict_tp_step(n_layer: int, tokens: int, width: int, sequence_parallel: bool, adam_uses: int = 3,
                    bytes_per: int = 4) -> dict:
    """The whole small GPT's collectives in one step of train_tp.py: the blocks plus what sits around them.

    Around the blocks: the head is column-parallel (its input gradient: one all-reduce of A; with sequence
    parallelism an all-gather in, a reduce-scatter back), and loss_parallel runs 3 all-reduces of one number
    per position (the largest logit, the sum of exponentials, the target's logit). With sequence
    parallelism, the first block's input is cut from the replicated embeddings (free) and gathered back in
    backward (one all-gather of A); and the LayerNorms' gradients stay pending sums (``Partial``) until
    AdamW uses them: one all-reduce of the parameter per use (``adam_uses``: lerp_ once, addcmul_ twice).
    """
    a, n = tokens * width * bytes_per, n_layer
    loss = [3, 3 * tokens * bytes_per]
    block = predict_block(tokens, width, sequence_parallel, bytes_per=bytes_per)

    def times(d, k):
        return {kind: [c * k, b * k] for kind, (c, b) in d.items()}

    fwd, bwd = times(block["forward"], n), times(block["backward"], n)
    if not sequence_parallel:
        fwd["all-reduce"] = [fwd["all-reduce"][0] + loss[0], fwd["all-reduce"][1] + loss[1]]
        bwd["all-reduce"] = [bwd["all-reduce"][0] + 1, bwd["all-reduce"][1] + a]
        return {"forward": fwd, "backward": bwd}
    fwd["all-gather"] = [fwd["all-gather"][0] + 1, fwd["all-gather"][1] + a]
    fwd["all-reduce"] = loss
    bwd["reduce-scatter"] = [bwd["reduce-scatter"][0] + 1, bwd["reduce-scatter"][1] + a]
    bwd["all-gather"] = [bwd["all-gather"][0] + 1, bwd["all-gather"][1] + a]
    norms = 2 * (2 * n + 1)  # weight and bias of ln1, ln2 in every block, and ln_f
    return {"forward": fwd, "backward": bwd,
            "optimizer": {"all-reduce": [adam_uses * norms, adam_uses * norms * width * bytes_per]}}


def compare(predicted: dict, counted: dict, prefix: str = "") -> bool:
    """Print one line per phase and kind: the predicted and the counted calls and bytes, and '=' or 'DIFFERENT';
    True when every line is equal. ``prefix`` starts each line (e.g. the mesh dimension)."""
    same = True
    for phase in counted | predicted:
        for kind in counted.get(phase, {}) | predicted.get(phase, {}):
            p, n = predicted.get(phase, {}).get(kind, [0, 0]), counted.get(phase, {}).get(kind, [0, 0])
            print(f"  {prefix}{phase:<9} {kind:<14} predicted {p[0]:>2} calls {p[1]:>9,} B   counted {n[0]:>2} calls "
                  f"{n[1]:>9,} B   {'=' if p == n else 'DIFFERENT'}")
            same = same and list(p) == list(n)
    return same


def same_counts(predicted: dict, counted: dict) -> bool:
    """True when every phase and kind has the same [calls, bytes] (the order of kinds does not matter)."""
    def norm(d):
        return {p: {k: list(v) for k, v in kinds.items()} for p, kinds in d.items() if kinds}
    return norm(predicted) == norm(counted)
