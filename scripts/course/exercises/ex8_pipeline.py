"""Exercise 8 (notebook 11): GPipe by hand on 2 processes, the small GPT cut in two stages.

The check runs ex8_pipeline.py on 2 processes with a seed and batch that are not the script's defaults, and
compares every rank's gradients after one GPipe step with the whole model's on one process (the batch's
mean loss). The mistakes it names, from the numbers:
- the micro-batch losses not divided by their number (every gradient exactly m times the reference), or
  divided by another number (every gradient the same exact factor off);
- the gradients not sent back (rank 0 waits for them: a hang, ended by the process-group timeout);
- stage 0's backward paired with the wrong micro-batch's gradient, or not run from the received gradient
  (rank 1's gradients right, rank 0's wrong);
- anything else on rank 1 (its gradients wrong).
"""

from pathlib import Path

import torch

from course.exercises.reference import NPROC, close, exact_factor, maxdiff, seeded
from course.exercises.results import Exercise, Verdict, fail
from course.exercises.running import failure, launch

CONFIG = {"batch_size": 24, "microbatches": 3, "seed": 5}  # not the script's defaults (16, 4, 0)
CONFIGS = (CONFIG, {"batch_size": 16, "microbatches": 2, "seed": 9})  # the tests check both


@seeded
def reference(batch_size: int, microbatches: int, seed: int) -> list[dict]:
    """Each stage's gradients (by the GPT's own names) from the whole model, on one process."""
    from course.gpt import GPT, GPTConfig, loss_fn
    from course.gpt_stages import GPTStage
    from course.lm_data import load_lm_data

    data = load_lm_data()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=data.block_size))
    x, y = data.batch("train", 0, batch_size, seed)
    loss_fn(model(x), y).backward()
    return [{name: p.grad for name, p in GPTStage(model, r, NPROC).named_parameters()} for r in range(NPROC)]


def _load(work: Path) -> list[dict]:
    saved = []
    for r in range(NPROC):
        path = work / f"ex8_rank{r}.pt"
        if not path.exists():
            fail("no-output", f"rank {r} saved no {path.name}: keep the torch.save(...) at the end of main().",
                 launched=True)
        saved.append(torch.load(path, weights_only=True))
    return saved


def _right(mine: dict, want: dict) -> bool:
    return set(mine) == set(want) and all(mine[n] is not None and close(mine[n], want[n]) for n in want)


def _factor(mine: dict, want: dict) -> float | None:
    """The one exact factor k with every gradient = k x the reference's, if there is one."""
    if set(mine) != set(want) or any(mine[n] is None for n in want):
        return None
    m = torch.cat([mine[n].double().flatten() for n in want])
    w = torch.cat([want[n].double().flatten() for n in want])
    ratio = float(m @ w / (w @ w))
    return exact_factor(ratio) if close(m, ratio * w) else None


def diagnose(saved: list[dict], ref: list[dict], microbatches: int) -> Verdict:
    """The first mistake the numbers show, or a pass."""
    for r, (mine, want) in enumerate(zip(saved, ref)):
        missing = [n for n in want if mine.get(n) is None]
        if missing:
            fail("no-grad", f"rank {r}: {len(missing)} of its {len(want)} parameters have no gradient "
                            f"(first: {missing[0]}): its backward never reached them.")
    factors = {_factor(m, w) for m, w in zip(saved, ref)}
    if factors == {float(microbatches)}:
        fail("not-scaled", f"every gradient on both ranks is exactly {microbatches} times the reference's: the "
                           f"{microbatches} micro-batch losses were summed, not averaged.")
    if len(factors) == 1 and None not in factors:
        fail("loss-scale", f"every gradient on both ranks is exactly {factors.pop():.4g} times the reference's: the "
                           "micro-batch losses were scaled by another number than their share of the batch.")
    right = [_right(m, w) for m, w in zip(saved, ref)]
    if right[1] and not right[0]:
        worst = max(maxdiff(saved[0][n], ref[0][n]) for n in ref[0])
        fail("stage0-backward", "rank 1's gradients equal the reference's, rank 0's do not (largest difference "
                                f"{worst:.2g}): stage 0's backward did not start from the right micro-batch's "
                                "received gradient.")
    if not right[1]:
        worst = max(maxdiff(saved[1][n], ref[1][n]) for n in ref[1])
        fail("stage1", f"rank 1's gradients differ from the reference's (largest difference {worst:.2g}).")
    return Verdict("pass", "pass", f"on {NPROC} ranks, {microbatches} micro-batches: every gradient of both stages "
                                   "equals the whole model's on one process.")


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--batch-size", CONFIG["batch_size"], "--microbatches", CONFIG["microbatches"],
                        "--seed", CONFIG["seed"]], work, backend, timeout)
    failure(run, path, timeout)
    return diagnose(_load(work), reference(**CONFIG), CONFIG["microbatches"])


HINTS = {
    "not-scaled": [
        "The gradients are right in direction but too large, by exactly the number of micro-batches.",
        ("The batch's loss is the mean over its samples; each micro-batch's mean loss covers 1/m of them. What must "
         "each micro-batch's loss be multiplied by so that the m backwards add up to the batch's gradient?"),
        "loss = loss_fn(stage(h), ym) / m"],
    "loss-scale": [
        "Every gradient is off by one exact factor: each micro-batch's loss was scaled by the wrong number.",
        ("The batch's loss is the mean over its samples, and each micro-batch's mean loss covers 1/m of them "
         "(m = the number of micro-batches, not the batch size)."),
        "loss = loss_fn(stage(h), ym) / m"],
    "hang": [
        ("Rank 0 waited for something rank 1 never sent: a dist.recv without its dist.send (the process-group "
         "timeout ended it). The lines above show where each rank was."),
        ("In the backward loop rank 0 receives one gradient per micro-batch. Which tensor must rank 1 send it, "
         "and after which call does that tensor exist?"),
        "After outputs[i].backward() on rank 1: dist.send(inputs[i].grad, dst=0)"],
    "stage0-backward": [
        "Stage 1 is right; stage 0's gradients are not, so its backward started from the wrong place.",
        ("Rank 0 must run the backward of the same micro-batch whose gradient it just received, from that "
         "gradient: both ranks go through the micro-batches in the same order."),
        "outputs[i].backward(grad): the output of micro-batch i, and the gradient received for it"],
    "stage1": [
        "Rank 1's gradients are wrong: look at its forward and its loss.",
        "Does rank 1 run its stage on the received activations h (after h.requires_grad_()), with this micro-batch's targets ym?",
        "loss = loss_fn(stage(h), ym) / m"],
    "no-grad": [
        "Some parameters got no gradient at all: a backward did not run on that rank.",
        "Each rank must call backward once per micro-batch: rank 1 on its loss, rank 0 on its output with the gradient received.",
        "Rank 0: outputs[i].backward(grad); rank 1: outputs[i].backward()"],
}

EXERCISES = [Exercise("8", "GPipe by hand", "ex8_pipeline.py", check, HINTS, notebook="11_pipeline_parallel")]
