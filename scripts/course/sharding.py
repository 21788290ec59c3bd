"""Memory and communication of sharded training (notebook 08): what to predict, and how to count it.

    predict(psi, ranks)               # bytes per rank: {strategy: {"parameters": ..., "gradients": ..., ...}}
    local_bytes(tensors)              # bytes this process holds for these tensors (a shared storage once)
    with CollectiveCounter() as comm: # every collective this process calls, with its size
        ...one training step...
    comm.summary(world_size)          # {collective: {"calls": n, "payload_bytes": ..., "sent_bytes": ...}}
    blocks(model)                     # the units FSDP shards one at a time in the course's models

The prediction counts *model states* (parameters, gradients, Adam's two moments, in fp32) and the working
copies a step needs besides them (bf16 copies under bf16 compute; the blocks FSDP2 gathers); activations,
communication buffers and the allocator's overhead are left out on purpose: the notebook measures them.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course import models

blocks = models.blocks  # the units FSDP shards in the memory figures (train_fsdp.py shards each layer with weights)

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2-like", "FSDP2")
PARTS = ("parameters", "gradients", "optimizer", "working copies")
FP32, BF16, ADAM = 4, 2, 8  # bytes per parameter: an fp32 value, a bf16 value, Adam's exp_avg + exp_avg_sq


def predict(psi: float, ranks: int, bf16: bool = False, blocks: int = 32) -> dict[str, dict[str, float]]:
    """Bytes per rank for ``psi`` parameters trained with Adam on ``ranks`` data-parallel ranks.

    fp32 (``bf16=False``), during a step (after forward, before backward):
      DDP          everything replicated                    4 + 4 + 8        bytes per parameter
      ZeRO-1       optimizer state sharded                  4 + 4 + 8/N
      ZeRO-2-like  FSDP2, reshard_after_forward=False: the  4 + 4/N + 4/N + 8/N
                   full parameters kept from forward to the end of backward, plus its own fp32 shard
      FSDP2        parameters, gradients, state sharded     4/N + 4/N + 8/N
    bf16 compute adds 16-bit working copies: autocast's cached bf16 weights (DDP, ZeRO-1), the full
    parameters gathered in bf16 instead of fp32 (ZeRO-2-like), ~2 blocks of ``blocks`` gathered in bf16
    (FSDP2: the block computing now and the one prefetched). In fp32, FSDP2's 2 gathered blocks are
    working copies too; the fp32 master parameters, gradients and Adam state do not change.
    """
    n = ranks
    shard = {"parameters": FP32 * psi / n, "gradients": FP32 * psi / n, "optimizer": ADAM * psi / n}
    full = FP32 * psi
    result = {
        "DDP": {"parameters": full, "gradients": full, "optimizer": ADAM * psi, "working copies": 0.0},
        "ZeRO-1": {"parameters": full, "gradients": full, "optimizer": ADAM * psi / n, "working copies": 0.0},
        # gathered full parameters, held from forward to the end of backward, next to the rank's own shard
        "ZeRO-2-like": {**shard, "parameters": full + FP32 * psi / n, "working copies": 0.0},
        "FSDP2": {**shard, "working copies": 2 * FP32 * psi / blocks},
    }
    if bf16:
        result["DDP"]["working copies"] = result["ZeRO-1"]["working copies"] = BF16 * psi
        result["ZeRO-2-like"]["parameters"] = FP32 * psi / n  # the gathered copy is bf16 now:
        result["ZeRO-2-like"]["working copies"] = BF16 * psi
        result["FSDP2"]["working copies"] = 2 * BF16 * psi / blocks
    return result


def model_states(prediction: dict[str, float]) -> float:
    """Parameters + gradients + optimizer state: what a measurement of the held tensors compares with."""
    return prediction["parameters"] + prediction["gradients"] + prediction["optimizer"]


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The memory behind a tensor on this process: for a sharded tensor (DTensor), its local shard's."""
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()


def local_bytes(tensors, exclude=()) -> int:
    """Bytes of storage behind ``tensors`` on this process: a sharded tensor counts its local shard only,
    padding included; tensors that share one storage (views, flat buffers) count it once; storages whose
    data pointer is in ``exclude`` are not counted."""
    seen, total = set(exclude), 0
    for t in tensors:
        if t is None:
            continue
        memory = storage(t)
        if memory.data_ptr() not in seen and memory.nbytes():
            seen.add(memory.data_ptr())
            total += memory.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (for ZeroRedundancyOptimizer: this rank's local optimizer)."""
    local = getattr(optimizer, "optim", optimizer)
    return [v for state in local.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


# The c10d operators behind the collectives, by the names the course uses.
NAMES = {"allreduce_": "all-reduce", "_allgather_base_": "all-gather", "_reduce_scatter_base_": "reduce-scatter",
         "broadcast_": "broadcast"}
# Bytes each rank sends for a collective on a payload of S bytes and N ranks (ring algorithms; notebook 02).
# A broadcast is received once by every rank but its root; summed over broadcasts from every rank in turn
# (ZeroRedundancyOptimizer), that is (N-1)/N of the payload per rank.
SENT = {"all-reduce": lambda s, n: 2 * (n - 1) / n * s, "all-gather": lambda s, n: (n - 1) / n * s,
        "reduce-scatter": lambda s, n: (n - 1) / n * s, "broadcast": lambda s, n: (n - 1) / n * s}


class CollectiveCounter(TorchDispatchMode):
    """Record every collective (``torch.ops.c10d.*``) this process issues inside ``with``, and its payload:
    the size of the largest tensor it touches (the full tensor: the all-gather output, the reduce-scatter
    input, the all-reduced bucket). DDP's reducer, ZeroRedundancyOptimizer and FSDP2 all go through these
    operators, so one counter sees all three. It slows every operation down: count, don't time, with it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
            payload = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.calls.append((NAMES.get(func._opname, func._opname), payload))
        return func(*args, **(kwargs or {}))

    def summary(self, world_size: int) -> dict[str, dict[str, float]]:
        """{collective: {"calls", "payload_bytes", "largest_bytes", "sent_bytes"}}; sent: what one rank
        sends (``SENT``)."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "payload_bytes": 0, "largest_bytes": 0, "sent_bytes": 0.0})
        for name, size in self.calls:
            entry = out[name]
            entry["calls"] += 1
            entry["payload_bytes"] += size
            entry["largest_bytes"] = max(entry["largest_bytes"], size)
            entry["sent_bytes"] += SENT.get(name, lambda s, n: s)(size, world_size)
        return dict(out)


