"""Exercise 9 (notebook 12): expert parallelism by hand on 2 processes, one expert per rank.

The check runs ex9_experts.py on 2 processes with a seed that is not the script's default and several
numbers of tokens per rank (one pass of the layer each; with the fewest, some rank sends an expert no token,
so a count that leaves an expert out shows), and compares each rank's outputs, input gradients and its
expert's gradients with the whole layer computed on one process (``course.moe``, every token, every expert).
The mistakes it names, from the numbers and from each rank's error:
- counts that leave out an expert that gets no token (a tensor shorter than the world size);
- splits that do not add up (all_to_all_single, or gloo under it, refuses them: "Split sizes doesn't match
  total dim 0 size", a message size that does not match): the dispatch's or the combine's splits the
  wrong way round, or counts never exchanged;
- the outputs combined in the wrong order (each rank's outputs are the right rows, in another order: the
  sort by destination not undone, or undone the wrong way);
- another rank's expert run on the received tokens;
- the gradients not travelling back (outputs right, input gradients wrong: a collective without autograd);
- anything else (the outputs differ).
"""

from pathlib import Path

import torch

from course.exercises.reference import NPROC, close, maxdiff, seeded
from course.exercises.results import Exercise, Stop, Verdict, fail
from course.exercises.running import failure, launch

CONFIG = {"tokens": (24, 2, 1), "seed": 3}  # not the script's defaults (16, 0); 2 and 1: an expert gets none
CONFIGS = (CONFIG, {"tokens": (9, 3), "seed": 4})  # the tests check both; seed 4, 3 tokens: each rank sends all away
SPLIT_ERRORS = ("Split sizes doesn't match", "doesn't match expected size", "does not match", "Invalid split")
COUNT_ERRORS = ("does not divide equally", "dim 0 must be", "divisible")


@seeded
def reference(tokens: int, seed: int) -> list[dict]:
    """Per rank: the one-process layer's outputs for its tokens, their gradients, the gates, the experts'
    outputs before the gate, the gradients of expert ``rank`` (every rank's tokens summed), and how many
    tokens the rank sends to each expert."""
    from course.moe import moe_layer, moe_tokens

    moe = moe_layer(NPROC, seed)
    xs = [moe_tokens(r, tokens, seed) for r in range(NPROC)]
    every = torch.cat(xs).requires_grad_()
    y = moe(every)
    y.sum().backward()
    with torch.no_grad():
        gate, expert = moe.route(every)
        unscaled = torch.stack([moe.experts[int(e)](t) for t, e in zip(every, expert)])
        expert0 = torch.stack([moe.experts[0](t) for t in every]) * gate[:, None]
    out = []
    for r in range(NPROC):
        rows = slice(r * tokens, (r + 1) * tokens)
        out.append({"x": xs[r].detach(), "y": y[rows].detach(), "x_grad": every.grad[rows], "gate": gate[rows], "unscaled": unscaled[rows],
                    "expert0": expert0[rows], "sends": torch.bincount(expert[rows], minlength=NPROC).tolist(),
                    "expert_grads": {n: p.grad for n, p in moe.experts[r].named_parameters()}})
    return out


def empty_pairs(config: dict) -> list[str]:
    """Where, in the check's configurations, a rank sends an expert no token (the cases a count must keep)."""
    return [f"{tokens} token{'s' if tokens > 1 else ''} per rank: rank {r} sends expert {e} none"
            for tokens in config["tokens"] for r, want in enumerate(reference(tokens, config["seed"]))
            for e, n in enumerate(want["sends"]) if n == 0]


def _load(work: Path, config: dict) -> list[list[dict]]:
    """Per rank, its results for each number of tokens."""
    saved = []
    for r in range(NPROC):
        path = work / f"ex9_rank{r}.pt"
        if not path.exists():
            fail("no-output", f"rank {r} saved no {path.name}: keep the torch.save(...) at the end of main().",
                 launched=True)
        results = torch.load(path, weights_only=True)
        if not isinstance(results, list) or [x.get("tokens") for x in results] != list(config["tokens"]):
            fail("no-output", f"rank {r}'s {path.name} does not hold one result per number of tokens "
                              f"{list(config['tokens'])}: keep main() of the script as it is.", launched=True)
        saved.append(results)
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


def diagnose(saved: list[dict], ref: list[dict], where: str = "") -> Verdict:
    """The first mistake the numbers of one configuration show (``where`` names it), or a pass."""
    for r, (mine, want) in enumerate(zip(saved, ref)):
        if not close(mine["y"], want["y"]):
            if _permuted(mine["y"], want):
                fail("combine-order", f"{where}rank {r}: every output is the right one, but in the wrong row: each "
                                      "token got another token's expert output.")
            if close(mine["y"], want["gate"][:, None] * want["x"]):
                fail("combine-inputs", f"{where}rank {r}: every output is its token's own input times its gate: what "
                                       "came back from the combine were the tokens, not the expert's outputs.")
            dropped = ((mine["y"] == 0).all(1) & ~(want["y"] == 0).all(1) if mine["y"].shape == want["y"].shape
                       else torch.zeros(0, dtype=torch.bool))  # another shape: not rows that are missing
            if dropped.any() and close(mine["y"][~dropped], want["y"][~dropped]):
                fail("dropped", f"{where}rank {r}: {int(dropped.sum())} of its {len(dropped)} tokens have an output "
                                "of zeros, and every other output is right: those tokens were dropped on the way.")
            if close(mine["y"], want["expert0"]):
                fail("wrong-expert", f"{where}rank {r}: every output is expert 0's, also for the tokens routed to "
                                     "another expert: the tokens a rank receives went through another rank's expert.")
            if mine["y"].shape != want["y"].shape:
                fail("out-shape", f"{where}rank {r}: the outputs have shape {tuple(mine['y'].shape)}, the "
                                  f"one-process layer's {tuple(want['y'].shape)} (one row per token, as many "
                                  "features as the tokens).")
            fail("outputs", f"{where}rank {r}: the outputs differ from the one-process layer's (largest difference "
                            f"{maxdiff(mine['y'], want['y']):.2g}).")
    for r, (mine, want) in enumerate(zip(saved, ref)):
        if mine["x_grad"] is None or not close(mine["x_grad"], want["x_grad"]):
            fail("no-grad-back", f"{where}rank {r}: the outputs are right, but the gradients of its tokens are not: "
                                 "the backward did not travel back through the exchanges.")
        grads = mine["expert_grads"]
        if any(grads.get(n) is None or not close(grads[n], g) for n, g in want["expert_grads"].items()):
            fail("expert-grads", f"{where}rank {r}: its expert's gradients differ from the one-process layer's.")
    return Verdict("pass", "pass", "")


def _named(stop: Stop, run, config: dict) -> None:
    """A crash or a hang read from each rank's error: counts of the wrong length, or splits that do not add up."""
    errors = " ".join(stop.verdict.facts.get("errors", {}).values()) or run.output
    pairs = empty_pairs(config)
    if any(m in errors for m in COUNT_ERRORS):
        fail("counts", f"{stop.verdict.symptom.rstrip('.')}. The exchange of the counts failed: a rank's count tensor does not "
                       f"have one count per rank (with {pairs[0] if pairs else 'few tokens'}).", status="error",
             launched=True)
    if any(m in errors for m in SPLIT_ERRORS):
        fail("splits", f"{stop.verdict.symptom.rstrip('.')}. The splits of an all_to_all_single do not add up to the rows it "
                       "sends or receives, or do not match the other rank's.", status="error", launched=True)


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--tokens", *CONFIG["tokens"], "--seed", CONFIG["seed"]], work, backend, timeout)
    try:
        failure(run, path, timeout)
    except Stop as stop:
        _named(stop, run, CONFIG)
        raise
    saved = _load(work, CONFIG)
    for i, tokens in enumerate(CONFIG["tokens"]):
        diagnose([s[i] for s in saved], reference(tokens, CONFIG["seed"]), f"with {tokens} tokens per rank, ")
    pairs = empty_pairs(CONFIG)
    return Verdict("pass", "pass", f"on {NPROC} ranks, with {', '.join(map(str, CONFIG['tokens']))} tokens each: the "
                                   "outputs, the tokens' gradients and every expert's gradients equal the one-process "
                                   "layer's" + (f", also where an expert gets no token ({pairs[0]})" if pairs else "")
                                   + ".")


HINTS = {
    "splits": [
        ("all_to_all_single refused its splits: they must add up to the rows of the tensor sent (input splits) "
         "and of the tensor received (output splits)."),
        ("Dispatch: this rank sends send[j] of its tokens to rank j and receives recv[j] from rank j. The "
         "functional all_to_all_single takes (tensor, output_split_sizes, input_split_sizes, group). The combine "
         "runs the same exchange backwards: which splits are its output's, and which its input's?"),
        ("received = all_to_all_single(x[order], recv_splits, send_splits, dist.group.WORLD); "
         "back = all_to_all_single(done, send_splits, recv_splits, dist.group.WORLD)")],
    "combine-inputs": [
        ("Each token came back as itself (times its gate): the combine sent back the tokens the expert received, "
         "not the expert's outputs."),
        "Which tensor does your combine's all_to_all_single send back: the one the expert made, or the one it was given?",
        "back = all_to_all_single(done, send_splits, recv_splits, dist.group.WORLD), with done = moe.experts[rank](received)"],
    "dropped": [
        ("Some tokens were dropped: their outputs are zeros while the others are right. Here every token must reach "
         "its expert and come back (no capacity limit, no token left out)."),
        ("Count the rows at each stage: the tokens sent (sum of send), received (sum of recv), run through the "
         "expert, sent back. Where do some go missing or get zeroed?"),
        "Run the expert on every received row (done = moe.experts[rank](received)) and put every row back."],
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
    "counts": [
        ("A rank's count tensor is too short when the last experts get none of its tokens: the exchange of the "
         "counts needs one count per rank."),
        "torch.bincount(t) has max(t) + 1 entries. How many does it have when no token of this rank goes to the last expert?",
        "send = torch.bincount(expert, minlength=world_size)"],
    "wrong-expert": [
        "The tokens a rank received went through another rank's expert.",
        "Rank r holds expert r: which expert does your line run on `received`?",
        "done = moe.experts[rank](received)"],
    "out-shape": [
        ("The layer's outputs have another shape than its tokens (one row per token, the tokens' features): a "
         "product or a sum on the way changed it, without an error."),
        ("Print the .shape of each tensor from `received` to the returned value. Which line makes it differ from "
         "x.shape? A (tokens,) gate against (tokens, features) outputs needs an axis to broadcast over the features."),
        "return gate[:, None] * out"],
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
