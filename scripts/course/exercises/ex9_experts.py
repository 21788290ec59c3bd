"""Exercise 9 (notebook 12): expert parallelism by hand on 2 processes, one expert per rank.

The check runs ex9_experts.py on 2 processes with a seed and a number of tokens that are not the script's
defaults, and compares each rank's outputs, input gradients and its expert's gradients with the whole layer
computed on one process (``course.moe``, every token, every expert). The mistakes it names, from the numbers:
- splits that do not add up (all_to_all_single refuses them: "Split sizes doesn't match total dim 0 size"),
  e.g. the dispatch's or the combine's splits the wrong way round;
- the outputs combined in the wrong order (each rank's outputs are the right rows, in another order: the
  sort by destination not undone, or undone the wrong way);
- the gradients not travelling back (outputs right, input gradients wrong: a collective without autograd);
- anything else (the outputs differ).
"""

from pathlib import Path

import torch

from course.exercises.reference import NPROC, close, maxdiff
from course.exercises.results import Exercise, Stop, Verdict, fail
from course.exercises.running import failure, launch

CONFIG = {"tokens": 24, "seed": 3}  # not the script's defaults (16, 0)
SPLIT_ERROR = "Split sizes doesn't match"


def reference(tokens: int, seed: int) -> list[dict]:
    """Per rank: the one-process layer's outputs for its tokens, their gradients, the gates, the experts'
    outputs before the gate, and the gradients of expert ``rank`` (every rank's tokens summed)."""
    from course.moe import moe_layer, moe_tokens

    moe = moe_layer(NPROC, seed)
    xs = [moe_tokens(r, tokens, seed) for r in range(NPROC)]
    every = torch.cat(xs).requires_grad_()
    y = moe(every)
    y.sum().backward()
    with torch.no_grad():
        gate, expert = moe.route(every)
        unscaled = torch.stack([moe.experts[int(e)](t) for t, e in zip(every, expert)])
    out = []
    for r in range(NPROC):
        rows = slice(r * tokens, (r + 1) * tokens)
        out.append({"y": y[rows].detach(), "x_grad": every.grad[rows], "gate": gate[rows], "unscaled": unscaled[rows],
                    "expert_grads": {n: p.grad for n, p in moe.experts[r].named_parameters()}})
    return out


def _load(work: Path) -> list[dict]:
    saved = []
    for r in range(NPROC):
        path = work / f"ex9_rank{r}.pt"
        if not path.exists():
            fail("no-output", f"rank {r} saved no {path.name}: keep the torch.save(...) at the end of main().",
                 launched=True)
        saved.append(torch.load(path, weights_only=True))
    return saved


def _permuted(y: torch.Tensor, want: dict) -> bool:
    """True when y's rows, each divided by its token's gate, are the right outputs in another order."""
    if y.shape != want["y"].shape:
        return False
    rows = y.double() / want["gate"].double()[:, None]
    distance = torch.cdist(rows, want["unscaled"].double())
    nearest = distance.argmin(1)
    found = distance.gather(1, nearest[:, None]).squeeze(1)
    scale = want["unscaled"].double().abs().max()
    return bool((found <= 1e-4 * scale).all()) and not torch.equal(nearest, torch.arange(len(y)))


def diagnose(saved: list[dict], ref: list[dict]) -> Verdict:
    """The first mistake the numbers show, or a pass."""
    for r, (mine, want) in enumerate(zip(saved, ref)):
        if not close(mine["y"], want["y"]):
            if _permuted(mine["y"], want):
                fail("combine-order", f"rank {r}: every output is the right one, but in the wrong row: each token "
                                      "got another token's expert output.")
            fail("outputs", f"rank {r}: the outputs differ from the one-process layer's (largest difference "
                            f"{maxdiff(mine['y'], want['y']):.2g}).")
    for r, (mine, want) in enumerate(zip(saved, ref)):
        if mine["x_grad"] is None or not close(mine["x_grad"], want["x_grad"]):
            fail("no-grad-back", f"rank {r}: the outputs are right, but the gradients of its tokens are not: the "
                                 "backward did not travel back through the exchanges.")
        grads = mine["expert_grads"]
        if any(grads.get(n) is None or not close(grads[n], g) for n, g in want["expert_grads"].items()):
            fail("expert-grads", f"rank {r}: its expert's gradients differ from the one-process layer's.")
    return Verdict("pass", "pass", f"on {NPROC} ranks, {len(ref[0]['y'])} tokens each: the outputs, the tokens' "
                                   "gradients and every expert's gradients equal the one-process layer's.")


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--tokens", CONFIG["tokens"], "--seed", CONFIG["seed"]], work, backend, timeout)
    try:
        failure(run, path, timeout)
    except Stop as stop:
        if SPLIT_ERROR in run.output:
            fail("splits", f"{stop.verdict.symptom} The splits of one all_to_all_single do not add up to the rows "
                           "it sends or receives.", status="error", launched=True)
        raise
    return diagnose(_load(work), reference(**CONFIG))


HINTS = {
    "splits": [
        ("all_to_all_single refused its splits: they must add up to the rows of the tensor sent (input splits) "
         "and of the tensor received (output splits)."),
        ("Dispatch: this rank sends send[j] of its tokens to rank j and receives recv[j] from rank j. The "
         "functional all_to_all_single takes (tensor, output_split_sizes, input_split_sizes, group). The combine "
         "runs the same exchange backwards: which splits are its output's, and which its input's?"),
        ("received = all_to_all_single(x[order], recv_splits, send_splits, dist.group.WORLD); "
         "back = all_to_all_single(done, send_splits, recv_splits, dist.group.WORLD)")],
    "combine-order": [
        ("The outputs are the right ones but in the wrong rows: the combine did not put each token's output back "
         "in that token's row."),
        ("The tokens were sent in the order `order` (sorted by destination), so row j of `back` belongs to token "
         "order[j]. Does your last step write row j into row order[j]?"),
        "out = torch.empty_like(back).index_copy(0, order, back)"],
    "no-grad-back": [
        ("The forward is right, but the gradients of the tokens are not: the backward did not go back through the "
         "exchanges."),
        ("dist.all_to_all_single (in torch.distributed) fills a buffer and is invisible to autograd. The one "
         "imported from torch.distributed._functional_collectives returns a new tensor and sends the gradients "
         "back in backward."),
        "received = all_to_all_single(x[order], recv_splits, send_splits, dist.group.WORLD) (the functional one)"],
    "outputs": [
        "The outputs differ from the one-process layer's: look at what each rank sends and to whom.",
        ("send[j] must count the tokens whose expert is j (torch.bincount with minlength=world_size), and the "
         "tokens must be sent sorted by expert: x[order]."),
        "send = torch.bincount(expert, minlength=world_size)"],
    "expert-grads": [
        "The outputs and the tokens' gradients are right, but an expert's gradients are not.",
        "Each rank must run its own expert, moe.experts[rank], on every token it received, and nothing else.",
        "done = moe.experts[rank](received)"],
}

EXERCISES = [Exercise("9", "Expert dispatch and combine by hand", "ex9_experts.py", check, HINTS,
                      notebook="12_composed_parallelism")]
