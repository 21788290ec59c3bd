"""Exercise 7 (notebook 10): column- and row-parallel linear layers by hand, with two autograd functions.

The check runs ex7_tp.py on 2 processes with a seed and width that are not the script's defaults, and
compares what every rank saved (the output, the input's gradient, its slices of the weight gradients)
with the unsplit MLP computed here. The mistakes it names, from the numbers:
- the row-parallel output not summed (each rank's output is a partial sum; the ranks' sum is right);
- the input's gradient not summed in Copy's backward (the output and the weight gradients are right,
  the ranks' input gradients add up to the reference);
- an all-reduce in the wrong direction: in Reduce's backward too (every gradient is world-size times
  the reference), or in Copy's forward (the input counted world-size times);
- a weight slice along the wrong dimension (shapes that do not fit, or a wrong output from the start).
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from course.exercises.reference import NPROC, close, exact_factor, maxdiff
from course.exercises.results import Exercise, Verdict, fail
from course.exercises.running import failure, launch

CONFIG = {"width": 24, "tokens": 6, "seed": 7}  # not the script's defaults (16, 8, 0)
NAMES = ("fc_weight_grad", "fc_bias_grad", "proj_weight_grad", "proj_bias_grad")


def reference(width: int, tokens: int, seed: int, world: int = NPROC) -> tuple[list[dict], torch.Tensor]:
    """What each rank should save (the unsplit MLP's results, sliced as rank r holds them), and proj's bias."""
    torch.manual_seed(seed)
    fc, proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
    x = torch.randn(tokens, width, requires_grad=True)
    out = proj(F.gelu(fc(x)))
    out.square().sum().backward()
    per_rank = [{"out": out.detach(), "x_grad": x.grad,
                 "fc_weight_grad": fc.weight.grad.chunk(world, 0)[r], "fc_bias_grad": fc.bias.grad.chunk(world, 0)[r],
                 "proj_weight_grad": proj.weight.grad.chunk(world, 1)[r], "proj_bias_grad": proj.bias.grad}
                for r in range(world)]
    return per_rank, proj.bias.detach()


def _load(work: Path) -> list[dict]:
    saved = []
    for r in range(NPROC):
        path = work / f"ex7_rank{r}.pt"
        if not path.exists():
            fail("no-output", f"rank {r} saved no {path.name}: keep the torch.save(...) at the end of main().",
                 launched=True)
        saved.append(torch.load(path, weights_only=True))
    return saved


def _factor(mine: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The exact factor k (or 1/k) with mine = k x ref, if there is one."""
    m, w = mine.double().flatten(), ref.double().flatten()
    if m.shape != w.shape or not float(w @ w) > 0:
        return None
    ratio = float(m @ w / (w @ w))
    return exact_factor(ratio) if close(m, ratio * w) else None


def diagnose(saved: list[dict], ref: list[dict], bias: torch.Tensor) -> Verdict:
    """The first mistake the numbers show, or a pass."""
    pairs = list(zip(saved, ref))
    for r, (mine, want) in enumerate(pairs):
        for name in ("out", "x_grad", *NAMES):
            if name not in mine or mine[name] is None or mine[name].shape != want[name].shape:
                got = "nothing" if mine.get(name) is None else f"shape {tuple(mine[name].shape)}"
                fail("shapes", f"rank {r}: {name} has {got}; the reference slice has shape "
                               f"{tuple(want[name].shape)}.")
    wrong = [r for r, (m, w) in enumerate(pairs) if not close(m["out"], w["out"])]
    if wrong:
        worst = max(maxdiff(m["out"], w["out"]) for m, w in pairs)
        # Reduce.forward without its all-reduce: rank r returns partial_r + bias; the partials add up.
        if close(sum(m["out"] for m in saved), ref[0]["out"] + (NPROC - 1) * bias):
            fail("no-forward-reduce", "the ranks' outputs differ from the reference, and their partial sums add "
                                      f"up to it: the output was never summed (largest difference {worst:.2g}).")
        fail("wrong-output", f"the output differs from the unsplit MLP's on rank {wrong[0]} "
                             f"(largest difference {worst:.2g}).")
    # proj's bias is added after Reduce: its gradient does not pass through Reduce.backward.
    factors = {_factor(m[n], w[n]) for m, w in pairs for n in ("x_grad", *NAMES) if n != "proj_bias_grad"}
    if factors == {float(NPROC)}:
        fail("backward-summed-twice", f"the output is right, but every gradient before the sum (all but proj's "
                                      f"bias) is exactly {NPROC} times the reference's: the output's gradient was "
                                      "summed over the ranks again.")
    bad = [(r, n) for r, (m, w) in enumerate(pairs) for n in NAMES if not close(m[n], w[n])]
    if bad:
        r, n = bad[0]
        fail("wrong-weight-grad", f"rank {r}: {n} differs from the reference's slice "
                                  f"(largest difference {maxdiff(saved[r][n], ref[r][n]):.2g}).")
    if not all(close(m["x_grad"], w["x_grad"]) for m, w in pairs):
        if close(sum(m["x_grad"] for m in saved), ref[0]["x_grad"]):
            fail("no-backward-reduce", "the output and every weight gradient are right, but each rank's input "
                                       "gradient is only a part: the ranks' input gradients add up to the right one.")
        fail("wrong-input-grad", "the output and the weight gradients are right, but the input's gradient is not "
                                 f"(largest difference {maxdiff(saved[0]['x_grad'], ref[0]['x_grad']):.2g}).")
    return Verdict("pass", "pass", f"on {NPROC} ranks the output, the input's gradient and every weight-gradient "
                                   "slice equal the unsplit MLP's.")


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--width", CONFIG["width"], "--tokens", CONFIG["tokens"], "--seed", CONFIG["seed"]],
                 work, backend, timeout)
    failure(run, path, timeout)
    return diagnose(_load(work), *reference(**CONFIG))


HINTS = {
    "no-forward-reduce": [
        "Each rank's output is only its rows' partial sum of proj's product.",
        "Which autograd function sits after the row-parallel layer, and what must its forward do with `out`?",
        "In Reduce.forward, call dist.all_reduce(out): the sum over the ranks, in place."],
    "no-backward-reduce": [
        "Each rank's input gradient comes only from its own columns of fc.",
        "The input reached every rank whole; in backward its gradient must be summed over the ranks. Where?",
        "In Copy.backward, call dist.all_reduce(grad) before returning it."],
    "backward-summed-twice": [
        ("The all-reduce ran in the wrong direction too: in backward the output's gradient is already the same "
         "on every rank."),
        "Look at Reduce.backward: summing a gradient that every rank holds whole multiplies it by the world size.",
        "Reduce.backward returns grad as it is (identity); only Copy.backward sums."],
    "shapes": [
        "A slice was cut along the wrong dimension of the weight.",
        ("nn.Linear stores weight as (out_features, in_features). Column parallel splits the outputs; row "
         "parallel the inputs."),
        "ColumnParallelLinear: full.weight.chunk(world, dim=0)[rank]; RowParallelLinear: chunk(world, dim=1)."],
    "wrong-output": [
        "The output is wrong, and not because a sum is missing.",
        "Check the slices (rows for fc, columns for proj) and that Copy's forward returns its input unchanged.",
        "An all-reduce in Copy.forward counts the input world-size times: it belongs in Copy.backward."],
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
