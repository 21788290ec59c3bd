"""The one-process reference and the comparison: a data-parallel run simulated in this process on the CPU
(``simulate``: world=1 with the global batch is the reference), the stated tolerance, and the step-by-step
comparison of the ranks' recorded parameters with it (``compare_traces``), whose first difference becomes
a diagnosis: ranks that disagree, a step an exact factor off (the world size: ``summed``/``halved``;
another: ``factor``), or a plain difference. A reference seeds torch's global generator: ``@seeded`` makes
the references of checks run in threads (the tests', the benchmark's) take turns, so none draws another's
initial weights.
"""

import copy
import functools
import threading
from dataclasses import dataclass

import torch
from torch import nn

from course.exercises.results import Verdict, fail

NPROC = 2  # processes of every launched check
ATOL, RTOL = 1e-5, 1e-4  # |yours - reference| <= ATOL + RTOL * |reference|: float32 rounding of another
# summation order stays far below it; every mistake the checks look for is far larger.
TOLERANCE = f"|Δ| ≤ {ATOL:g} + {RTOL:g}·|reference|"
FACTORS = (2, 3, 4, 8)  # exact factors a step can be off by that a check names
_GLOBAL_RNG = threading.RLock()


def seeded(fn):
    """For a function that seeds and draws from torch's global generator: one such call at a time, in any thread."""
    @functools.wraps(fn)
    def one_at_a_time(*args, **kwargs):
        with _GLOBAL_RNG:
            return fn(*args, **kwargs)
    return one_at_a_time


def close(a, b) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return a.shape == b.shape and bool(((a - b).abs() <= ATOL + RTOL * b.abs()).all())


def maxdiff(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max()) if a.numel() else 0.0


def _flat(params) -> torch.Tensor:
    return torch.cat([torch.as_tensor(p, dtype=torch.float64).flatten() for p in params])


def update_ratio(before, after, ref_after) -> float:
    """How far a step moved the parameters compared with the reference step from the same point."""
    mine, ref = _flat(after) - _flat(before), _flat(ref_after) - _flat(before)
    return float(mine @ ref / (ref @ ref)) if float(ref @ ref) > 0 else float("nan")


def exact_factor(ratio: float) -> float | None:
    """k or 1/k (k in FACTORS) when ``ratio`` is within 2 % of it, else None."""
    for k in FACTORS:
        for f in (k, 1 / k):
            if abs(ratio - f) < 0.02 * f:
                return f
    return None


def constant_ratio(mine, ref) -> float | None:
    """The exact factor between two series when every element has it (None otherwise)."""
    ratios = [a / b for a, b in zip(mine, ref) if b]
    if not ratios or len(mine) != len(ref):
        return None
    f = exact_factor(ratios[0])
    return f if f is not None and all(abs(r - f) < 1e-3 * f for r in ratios) else None


@dataclass
class Trajectory:
    """A training run of the reference (or of a simulated mistake): losses, parameters, validation."""

    names: list
    params: list  # parameters at step 0, 1, ... (lists of tensors)
    losses: list  # global loss of each step (mean over the ranks' losses)
    rank_losses: list  # per step, each simulated rank's own loss
    val: tuple = ()


@seeded
def simulate(build, data, loss_fn, *, world=1, per_rank=32, epochs=1, steps=None, lr=0.1, momentum=0.0,
              optimizer="sgd", seed=0, sampler="distributed", set_epoch=True, reduce="mean", accum=1,
              loss_scale=1.0, val=None, val_fn=None, order_seed=None) -> Trajectory:
    """Train ``world`` simulated ranks in this process, on the CPU, as a data-parallel script would.

    world=1 with the global batch is the single-process reference. sampler: "distributed" (every rank
    takes every world-th index of a seeded permutation, new with each epoch if set_epoch), "same" (no
    sharding: every rank the whole permutation), "fixed" (no shuffle: global batch k is samples
    [k*B, (k+1)*B), rank r takes every world-th of it). reduce: how the ranks combine their gradients:
    "mean" (data parallelism), "sum" (a sum never divided), None (never shared).
    order_seed: the sampler's seed when it is not ``seed`` (a sampler left at its default seed).
    """
    torch.manual_seed(seed)
    model0 = build()
    models = [model0] + [copy.deepcopy(model0) for _ in range(world - 1)]
    if optimizer == "adam":
        opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in models]
    else:
        opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    x_all, y_all = data.tensors
    n = len(x_all)
    traj = Trajectory([name for name, _ in model0.named_parameters()],
                      [[p.detach().clone() for p in model0.parameters()]], [], [])
    micro = per_rank
    for epoch in range(epochs):
        if sampler == "fixed":
            order = torch.arange(n)
        else:
            g = torch.Generator().manual_seed((seed if order_seed is None else order_seed)
                                             + (epoch if set_epoch else 0))
            order = torch.randperm(n, generator=g)
        shards = [order[r::world] for r in range(world)] if sampler in ("distributed", "fixed") else [order] * world
        if sampler == "fixed":  # global batch k = samples [kB, (k+1)B); rank r takes every world-th of it
            gb = per_rank * world
            shards = [torch.cat([order[k * gb:(k + 1) * gb][r::world] for k in range(n // gb)]) for r in range(world)]
        n_steps = len(shards[0]) // (micro * accum)
        if steps is not None:
            n_steps = min(n_steps, steps - len(traj.losses))
        for k in range(n_steps):
            step_losses = [0.0] * world
            for m, o in zip(models, opts):
                o.zero_grad()
            for a in range(accum):
                for r, m in enumerate(models):
                    idx = shards[r][(k * accum + a) * micro:(k * accum + a + 1) * micro]
                    loss = loss_fn(m(x_all[idx]), y_all[idx])
                    (loss * loss_scale / accum).backward()
                    step_losses[r] += loss.item() / accum
            if reduce and world > 1:
                for ps in zip(*(m.parameters() for m in models)):
                    combined = torch.stack([p.grad for p in ps]).sum(0) / (world if reduce == "mean" else 1)
                    for p in ps:
                        p.grad.copy_(combined)
            for o in opts:
                o.step()
            traj.losses.append(sum(step_losses) / world)
            traj.rank_losses.append(step_losses)
            traj.params.append([p.detach().clone() for p in model0.parameters()])
        if steps is not None and len(traj.losses) >= steps:
            break
    if val is not None and val_fn is not None:
        with torch.no_grad():
            traj.val = val_fn(model0, val)
    return traj


def wave_val(model, val):
    x, y = val.tensors
    return int((model(x).argmax(1) == y).sum()), len(y)


def mse_val(model, val):
    x, y = val.tensors
    return float(nn.functional.mse_loss(model(x), y, reduction="sum")), len(y)


def compare_traces(traces: list[dict], ref: Trajectory, what: str, *, loss_ref: Trajectory | None = None,
                   seconds: float = 0.0) -> Verdict:
    """Every rank's parameters at step 0, 1, ... against the reference's; the first difference diagnosed.
    loss_ref: simulated ranks whose own losses each rank's recorded losses must equal."""
    n = len(ref.params) - 1
    for r, t in enumerate(traces):
        if len(t["params"]) != n + 1:
            fail("steps", f"rank {r} recorded {len(t['params']) - 1} steps, the reference made {n}.", launched=True)
    names = traces[0]["names"]
    p0 = [t["params"][0] for t in traces]
    if not all(close(a, b) for a, b in zip(p0[0], p0[1])):
        diff = max(maxdiff(a, b) for a, b in zip(p0[0], p0[1]))
        fail("no-broadcast", f"at step 0, before any training, rank 1's parameters differ from rank 0's "
              f"(max |Δ| {diff:.2g}): the copies start from different weights.", launched=True)
    if not all(close(a, b) for a, b in zip(p0[0], ref.params[0])):
        fail("wrong-start", "at step 0 both ranks hold the same parameters, but not rank 0's initial weights "
              "(the reference starts from those).", launched=True)
    for k in range(1, n + 1):
        mine = [t["params"][k] for t in traces]
        ok = [all(close(a, b) for a, b in zip(m, ref.params[k])) for m in mine]
        if all(ok):
            continue
        same = all(close(a, b) for a, b in zip(mine[0], mine[1]))
        if not same:
            bad = [nm for nm, a, b in zip(names, mine[0], mine[1]) if not close(a, b)]
            fail("ranks-differ", f"after step {k} the ranks' copies differ ({len(bad)} of {len(names)} parameters: "
                  f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}); before it they were equal.", launched=True)
        ratio = update_ratio(traces[0]["params"][k - 1], mine[0], ref.params[k])
        facts = {"launched": True, "ratio": ratio, "step": k}
        if abs(ratio - NPROC) < 0.02 * NPROC:
            fail("summed", f"after step {k} both ranks agree, but the step moved the parameters {ratio:.2f}× as far "
                 f"as the reference step from the same point: the world size ({NPROC}).", **facts)
        if abs(ratio - 1 / NPROC) < 0.02:
            fail("halved", f"after step {k} both ranks agree, but the step moved the parameters {ratio:.2f}× as far "
                 f"as the reference step from the same point: 1 / the world size ({NPROC}).", **facts)
        factor = exact_factor(ratio)
        if factor is not None:
            fail("factor", f"after step {k} both ranks agree, but the step moved the parameters exactly "
                 f"{ratio:.2f}× as far as the reference step from the same point (the world size is {NPROC}).",
                 **facts)
        worst = max(maxdiff(a, b) for a, b in zip(mine[0], ref.params[k]))
        fail("differs", f"after step {k} both ranks agree with each other but not with the reference (max |Δ| "
              f"{worst:.2g}; the step is {ratio:.2f}× the reference's; {TOLERANCE}).", **facts)
    worst = max(maxdiff(a, b) for t in traces for m, rp in zip(t["params"], ref.params) for a, b in zip(m, rp))
    if loss_ref is not None:  # each rank records the loss of its own share of the batch
        for r, t in enumerate(traces):
            mine, want = t["losses"], [rl[r] for rl in loss_ref.rank_losses]
            if not close(mine, want):
                fail("loss-differs", f"the parameters match, but rank {r}'s recorded losses do not (first: "
                      f"{mine[0]:.6f} vs {want[0]:.6f}).", launched=True)
    return Verdict("pass", "pass", f"{n} steps: both ranks' parameters equal the single-process reference "
                   f"({what}, max |Δ| {worst:.1e}; {TOLERANCE}).", {"launched": True, "seconds_run": round(seconds, 1)})

