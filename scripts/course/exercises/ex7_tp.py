"""Exercise 7 (notebook 10): column- and row-parallel linear layers by hand, with two autograd functions.

The check runs ex7_tp.py on 2 processes with a seed and width that are not the script's defaults, and
compares what every rank saved with the unsplit MLP computed here: the output and the input's gradient
whole, and each weight gradient put back where the rank's slice sits in the unsplit weight (read from the
slices it saved), so any consistent split passes: contiguous chunks or a stride. The mistakes it names:
- slices that do not split the layer (a hidden unit on no rank or on two, fc's rows and proj's columns
  not the same units), or cut along the wrong dimension (the shapes do not fit: a crash in forward);
- the row-parallel output not summed (the ranks' outputs differ; they add up to the reference), or
  averaged (the same on every rank, the partial products halved), or proj's bias added on every rank;
- the all-reduce in the wrong direction: in Reduce's backward too (every gradient world-size times the
  reference), or in Copy's forward (the input counted world-size times);
- the input's gradient not summed in Copy's backward (the ranks' input gradients add up to the
  reference) or averaged (the same on every rank, 1/world-size of it).
"""

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from course.exercises.reference import NPROC, close, exact_factor, maxdiff, seeded
from course.exercises.results import Exercise, Stop, Verdict, fail
from course.exercises.running import failure, launch

CONFIG = {"width": 24, "tokens": 6, "seed": 7}  # not the script's defaults (16, 8, 0)
CONFIGS = (CONFIG, {"width": 8, "tokens": 3, "seed": 11})  # the tests check both
GRADS = ("fc_weight_grad", "fc_bias_grad", "proj_weight_grad", "proj_bias_grad")
SHAPE_ERROR = re.compile(r"cannot be multiplied|must match the size|size mismatch|shape .* is invalid", re.IGNORECASE)


@seeded
def reference(width: int, tokens: int, seed: int, x_scale: float = 1.0) -> dict:
    """The unsplit MLP's output, input gradient, weights and whole weight gradients (x_scale: the input
    counted that many times, as an all-reduce in Copy's forward would)."""
    torch.manual_seed(seed)
    fc, proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
    x = torch.randn(tokens, width, requires_grad=True)
    out = proj(F.gelu(fc(x * x_scale)))
    out.square().sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "fc_weight": fc.weight.detach(), "proj_weight": proj.weight.detach(),
            "proj_bias": proj.bias.detach(), "fc_weight_grad": fc.weight.grad, "fc_bias_grad": fc.bias.grad,
            "proj_weight_grad": proj.weight.grad, "proj_bias_grad": proj.bias.grad}


def _load(work: Path) -> list[dict]:
    saved = []
    for r in range(NPROC):
        path = work / f"ex7_rank{r}.pt"
        if not path.exists():
            fail("no-output", f"rank {r} saved no {path.name}: keep the torch.save(...) at the end of main().",
                 launched=True)
        saved.append(torch.load(path, weights_only=True))
    return saved


def _positions(part: torch.Tensor, whole: torch.Tensor) -> list[int] | None:
    """Where each row of ``part`` is in ``whole`` (an exact copy), or None if one is not there."""
    if part.dim() != 2 or part.shape[1] != whole.shape[1]:
        return None
    found = [(whole == row).all(1).nonzero() for row in part]
    return [int(f[0]) for f in found] if all(len(f) for f in found) else None


def _slices(saved: list[dict], ref: dict) -> list[list[int]]:
    """Per rank, the hidden units (fc's rows = proj's columns) it holds; a split that is not one is a mistake."""
    units = []
    hidden = ref["fc_weight"].shape[0]
    for r, mine in enumerate(saved):
        rows = _positions(mine["fc_weight"], ref["fc_weight"])
        cols = _positions(mine["proj_weight"].T, ref["proj_weight"].T)
        if rows is None or cols is None:
            which, got, whole = (("fc", mine["fc_weight"], ref["fc_weight"]) if rows is None else
                                 ("proj", mine["proj_weight"], ref["proj_weight"]))
            fail("shapes", f"rank {r}: {which}'s weight slice has shape {tuple(got.shape)}; it is not made of whole "
                           f"{'rows' if which == 'fc' else 'columns'} of the unsplit weight {tuple(whole.shape)}.")
        if rows != cols:
            fail("slices", f"rank {r} holds fc's rows {rows[:4]}... but proj's columns {cols[:4]}...: a hidden "
                           "unit's column of proj must sit on the rank that computes that unit.")
        units.append(rows)
    every = sorted(u for rows in units for u in rows)
    if every != list(range(hidden)):
        fail("slices", f"the ranks hold {len(every)} hidden units between them ({len(set(every))} different) of "
                       f"{hidden}: each must be on exactly one rank.")
    return units


def _factor(mine: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The exact factor k (or 1/k) with mine = k x ref, if there is one."""
    m, w = mine.double().flatten(), ref.double().flatten()
    if m.shape != w.shape or not float(w @ w) > 0:
        return None
    ratio = float(m @ w / (w @ w))
    return exact_factor(ratio) if close(m, ratio * w) else None


def _outputs(saved: list[dict], ref: dict, config: dict) -> None:
    outs = [m["out"] for m in saved]
    if all(close(o, ref["out"]) for o in outs):
        return
    worst = max(maxdiff(o, ref["out"]) for o in outs)
    bias, same = ref["proj_bias"], all(close(o, outs[0]) for o in outs)
    if same and close(outs[0], ref["out"] + (NPROC - 1) * bias):
        fail("bias-twice", f"every rank has the same output, exactly the reference plus {NPROC - 1} more copy of "
                           "proj's bias: the bias was added on every rank before the sum.")
    if same and close(outs[0] - bias, (ref["out"] - bias) / NPROC):
        fail("forward-averaged", f"every rank has the same output, but without the bias it is exactly 1/{NPROC} of "
                                 "the reference's: the partial products were averaged, not summed.")
    if same and close(outs[0], reference(**config, x_scale=NPROC)["out"]):
        fail("copy-forward-reduce", f"every rank has the same output: the one the unsplit MLP gives for the input "
                                    f"taken {NPROC} times: the input was summed over the ranks on its way in.")
    if not same and close(outs[0], ref["out"]):
        fail("reduce-one-rank", "rank 0's output equals the unsplit MLP's and the other ranks' do not (largest "
                                f"difference {worst:.2g}): the sum reached rank 0 only.")
    if not same and close(sum(outs), ref["out"] + (NPROC - 1) * bias):
        fail("no-forward-reduce", "the ranks' outputs differ from the reference, and their partial sums add up to "
                                  f"it: the output was never summed (largest difference {worst:.2g}).")
    fail("wrong-output", f"the output differs from the unsplit MLP's (largest difference {worst:.2g}; the ranks "
                         f"{'agree' if same else 'differ'}).")


def diagnose(saved: list[dict], ref: dict, config: dict = CONFIG) -> Verdict:
    """The first mistake the numbers show, or a pass."""
    for r, mine in enumerate(saved):
        for name in ("out", "x_grad", *GRADS, "fc_weight", "proj_weight"):
            if name in mine and mine[name] is None and name != "out":  # saved, but backward() never reached it
                fail("grad-none", f"rank {r} saved {name} as None: backward() gave that tensor no gradient.")
            if mine.get(name) is None:
                fail("no-output", f"rank {r} saved no {name}: keep the torch.save(...) of the script as it is.")
        for name in ("out", "x_grad"):
            if mine[name].shape != ref[name].shape:
                fail("shapes", f"rank {r}: {name} has shape {tuple(mine[name].shape)}; the unsplit MLP's has "
                               f"{tuple(ref[name].shape)}.")
    units = _slices(saved, ref)
    _outputs(saved, ref, config)
    # each rank's gradients, and the reference's at the same places (proj's bias is whole on every rank)
    pairs = [{"fc_weight_grad": (m["fc_weight_grad"], ref["fc_weight_grad"][u]),
              "fc_bias_grad": (m["fc_bias_grad"], ref["fc_bias_grad"][u]),
              "proj_weight_grad": (m["proj_weight_grad"], ref["proj_weight_grad"][:, u]),
              "proj_bias_grad": (m["proj_bias_grad"], ref["proj_bias_grad"]),
              "x_grad": (m["x_grad"], ref["x_grad"])} for m, u in zip(saved, units)]
    # proj's bias is added after Reduce: its gradient does not pass through Reduce.backward
    factors = {_factor(*p[n]) for p in pairs for n in ("x_grad", *GRADS) if n != "proj_bias_grad"}
    if factors == {float(NPROC)}:
        fail("backward-summed-twice", f"the output is right, but every gradient before the sum (all but proj's "
                                      f"bias) is exactly {NPROC} times the reference's: the output's gradient was "
                                      "summed over the ranks again.")
    if factors == {1 / NPROC}:
        fail("backward-divided", f"the output is right, but every gradient before the sum (all but proj's bias) is "
                                 f"exactly 1/{NPROC} of the reference's: the output's gradient was divided by the "
                                 "world size on its way back.")
    for r, p in enumerate(pairs):
        for name in GRADS:
            mine, want = p[name]
            if mine.shape != want.shape or not close(mine, want):
                fail("wrong-weight-grad", f"rank {r}: {name} differs from the reference's at the same places "
                                          f"(largest difference {maxdiff(mine, want) if mine.shape == want.shape else 'shape'}).")
    x_grads = [m["x_grad"] for m in saved]
    if not all(close(g, ref["x_grad"]) for g in x_grads):
        same = all(close(g, x_grads[0]) for g in x_grads)
        if same and close(x_grads[0], ref["x_grad"] / NPROC):
            fail("backward-averaged", f"the output and every weight gradient are right, and the input's gradient is "
                                      f"the same on every rank, but exactly 1/{NPROC} of the reference's: the ranks' "
                                      "shares were averaged, not summed.")
        if close(x_grads[0], ref["x_grad"]):
            fail("reduce-one-rank", "the output and every weight gradient are right, and rank 0's input gradient too, "
                                    "but not the other ranks': the sum reached rank 0 only.")
        if close(sum(x_grads), ref["x_grad"]):
            fail("no-backward-reduce", "the output and every weight gradient are right, but each rank's input "
                                       "gradient is only a part: the ranks' input gradients add up to the right one.")
        fail("wrong-input-grad", "the output and the weight gradients are right, but the input's gradient is not "
                                 f"(largest difference {maxdiff(x_grads[0], ref['x_grad']):.2g}).")
    split = "contiguous" if all(u == sorted(u) and u[-1] - u[0] == len(u) - 1 for u in units) else "strided"
    return Verdict("pass", "pass", f"on {NPROC} ranks ({split} slices) the output, the input's gradient and every "
                                   "weight gradient, put back in place, equal the unsplit MLP's.")


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--width", CONFIG["width"], "--tokens", CONFIG["tokens"], "--seed", CONFIG["seed"]],
                 work, backend, timeout)
    try:
        failure(run, path, timeout)
    except Stop as stop:
        error = stop.verdict.facts.get("errors", {}).get(stop.verdict.facts.get("rank"), "")
        if stop.verdict.diagnosis == "crash" and SHAPE_ERROR.search(error):
            fail("shapes", f"{stop.verdict.symptom.rstrip('.')}. The shapes of a weight slice and of what it multiplies do not "
                           "fit.", status="error", launched=True)
        raise
    return diagnose(_load(work), reference(**CONFIG), CONFIG)


HINTS = {
    "no-forward-reduce": [
        "Each rank's output is only its rows' partial sum of proj's product.",
        "Which autograd function sits after the row-parallel layer, and what must its forward do with `out`?",
        "In Reduce.forward, call dist.all_reduce(out): the sum over the ranks, in place."],
    "forward-averaged": [
        ("The output is the same on every rank but too small: the ranks' partial products were averaged. Each "
         "holds a part of one sum: the whole is their sum."),
        "Which reduction does your all_reduce in Reduce.forward use?",
        "dist.all_reduce(out) (ReduceOp.SUM, the default), not ReduceOp.AVG."],
    "bias-twice": [
        "proj's bias was added once per rank: the output is the reference plus another copy of the bias.",
        "Where is the bias added: before the partial products are summed, or after?",
        "RowParallelLinear.forward: Reduce.apply(F.linear(x_slice, self.weight)) + self.bias (the bias after the sum)."],
    "copy-forward-reduce": [
        "The input was summed over the ranks on its way into the column-parallel layer: every rank already had it whole.",
        "Copy's forward is the identity; its all-reduce belongs to the backward.",
        "Copy.forward returns x unchanged; Copy.backward sums the gradient."],
    "no-backward-reduce": [
        "Each rank's input gradient comes only from its own columns of fc.",
        "The input reached every rank whole; in backward its gradient must be summed over the ranks. Where?",
        "In Copy.backward, call dist.all_reduce(grad) before returning it."],
    "backward-averaged": [
        ("The input's gradient is the same on every rank but too small: the ranks' shares were averaged. Each rank's "
         "columns contribute a part of the gradient: the whole is their sum."),
        "Which reduction does your all_reduce in Copy.backward use?",
        "dist.all_reduce(grad) (ReduceOp.SUM, the default), not ReduceOp.AVG."],
    "backward-summed-twice": [
        ("The all-reduce ran in the wrong direction too: in backward the output's gradient is already the same "
         "on every rank."),
        "Look at Reduce.backward: summing a gradient that every rank holds whole multiplies it by the world size.",
        "Reduce.backward returns grad as it is (identity); only Copy.backward sums."],
    "reduce-one-rank": [
        ("The sum reached rank 0 only: dist.reduce leaves the sum on its dst rank alone, while every rank needs the "
         "whole result (each computes the next layer, or the input's gradient, with it)."),
        "Which collective leaves the sum on every rank? Look at the dist.* call in Reduce.forward and Copy.backward.",
        "dist.all_reduce(out) in Reduce.forward; dist.all_reduce(grad) in Copy.backward."],
    "backward-divided": [
        ("Every gradient is exactly 1/world size of the reference's: the output's gradient was divided by the "
         "world size on its way back. In tensor parallelism each rank holds the whole output: nothing is averaged."),
        ("Look for a division by the world size between the loss and the layers: in Reduce.backward, or the "
         "loss itself (DDP habits: the ranks here do not hold copies of one model)."),
        "Reduce.backward returns grad as it is, and the loss is not divided by the world size."],
    "shapes": [
        "A slice was cut along the wrong dimension of the weight: its shape does not fit what it multiplies.",
        ("nn.Linear stores weight as (out_features, in_features). Column parallel splits the outputs; row "
         "parallel the inputs."),
        "ColumnParallelLinear: full.weight.chunk(world, dim=0)[rank]; RowParallelLinear: chunk(world, dim=1)."],
    "slices": [
        "The ranks' slices do not split the hidden layer: each hidden unit must be computed on exactly one rank.",
        ("fc's row j and proj's column j belong to hidden unit j: the rank that holds one must hold the other, and "
         "together the ranks hold every unit once. Which rank index does each slice use?"),
        "fc: full.weight.chunk(world, dim=0)[rank]; proj: full.weight.chunk(world, dim=1)[rank] (the same rank)."],
    "grad-none": [
        ("A gradient the script saves is None: backward() never reached that tensor. Two causes give this: the "
         "tensor did not require grad (a slice made with detach() but not wrapped in nn.Parameter), or an autograd "
         "Function on the way back returned None instead of the gradient."),
        ("Which tensor's gradient is None (the line above names it)? Follow the path from the loss back to it: "
         "each backward() of Copy and Reduce on that path must return a tensor."),
        ("Wrap each slice in nn.Parameter(...detach().clone()); Copy.backward returns the summed grad, "
         "Reduce.backward returns grad.")],
    "wrong-output": [
        "The output is wrong, and not because a sum is missing.",
        "Check the slices (rows for fc, columns for proj) and that Copy's forward returns its input unchanged.",
        "Compare your slicing with the docstring of tp_by_hand.py in notebook 10."],
    "wrong-weight-grad": [
        "The output is right but a weight gradient is not.",
        "Is every slice a fresh nn.Parameter (detach().clone()), and does each rank keep its own slice?",
        "Compare your slicing with the docstring of tp_by_hand.py in notebook 10."],
    "wrong-input-grad": [
        "The input's gradient is wrong in a way a missing sum does not explain.",
        "Copy.backward should sum the gradient over the ranks once, and Reduce.backward pass it through.",
        "Copy.backward: grad = grad.clone(); dist.all_reduce(grad); return grad."],
}

EXERCISES = [Exercise("7", "Tensor parallelism by hand", "ex7_tp.py", check, HINTS, notebook="10_tensor_parallel")]
