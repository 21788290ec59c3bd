"""Exercise 2: DDP by hand: broadcast rank 0's weights once, then average every gradient with all_reduce.

The check runs ex2_by_hand.py on 2 processes (each with its own seed, so the copies start apart) and
compares both ranks' parameters with one process on the whole batch after each of 10 steps: a sum not
divided is exactly world-size times the step, a missing broadcast shows at step 0, a collective that only
one rank calls hangs (the process-group timeout ends it).
"""

from pathlib import Path

from torch import nn

from course.exercise_tasks import mlp, regression_data
from course.exercises.ex4_overlap import check_waits
from course.exercises.reference import NPROC, Trajectory, compare_traces, simulate
from course.exercises.results import Exercise, Stop, Verdict, fail
from course.exercises.running import failure, launch, load_traces, per_step

CONFIG = {"steps": 10, "batch": 32, "lr": 0.1, "seed": 5}  # seed 5: not the script's default
CONFIGS = (CONFIG, {"steps": 6, "batch": 16, "lr": 0.05, "seed": 9})  # the tests check both


def reference(world: int = 1, reduce: str | None = "mean") -> Trajectory:
    """world=1: one process on the whole batch; else that many simulated ranks combining gradients by ``reduce``."""
    data = regression_data(CONFIG["steps"] * CONFIG["batch"], seed=CONFIG["seed"])
    return simulate(lambda: mlp(8, 32, 32, 1), data, nn.functional.mse_loss, world=world,
                    per_rank=CONFIG["batch"] // world, steps=CONFIG["steps"], lr=CONFIG["lr"], seed=CONFIG["seed"],
                    sampler="fixed", reduce=reduce)


def _broadcast_everywhere(run) -> bool:
    """Whether every rank called broadcast before its first step (the recorder's collectives)."""
    return len(run.records) == NPROC and all(
        any(c["op"] == "broadcast" and (not rec["steps"] or c["t"] < rec["steps"][0]) for c in rec["collectives"])
        for rec in run.records.values())


def _same_broadcast_hang(run) -> bool:
    """Whether every rank's last collective was a broadcast at the same line: all of them called it, and yet it
    never matched (each rank gave another src)."""
    last = [rec["collectives"][-1] for rec in run.records.values() if rec["collectives"]]
    return len(last) == NPROC and all(c["op"] == "broadcast" and c["where"] == last[0]["where"] for c in last)


def _gradients_broadcast(run) -> bool:
    """Whether the ranks broadcast during their steps (after the first) and never all-reduced: one rank's gradient
    copied to the others, not the average."""
    recs = list(run.records.values())
    return bool(recs) and all(any(calls for calls in per_step(rec, "broadcast")[1:])
                              and not any(per_step(rec, "all_reduce")) for rec in recs)


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--steps", CONFIG["steps"], "--batch-size", CONFIG["batch"], "--lr", CONFIG["lr"],
                        "--seed", CONFIG["seed"]], work, backend, timeout)
    try:
        failure(run, path, timeout)
    except Stop as stop:
        if stop.verdict.diagnosis == "hang" and _same_broadcast_hang(run):
            fail("src-differs", f"{stop.verdict.symptom.rstrip('.')}. Every rank was in the same broadcast, at the "
                 "same line: all called it, and it still never matched.", status="error", launched=True)
        raise
    check_waits(run.records)
    try:
        return compare_traces(load_traces(run), reference(), "every step", loss_ref=reference(NPROC),
                              seconds=run.seconds)
    except Stop as stop:
        v = stop.verdict
        if v.diagnosis == "no-broadcast" and _broadcast_everywhere(run):
            fail("src-differs", f"{v.symptom} Yet every rank called broadcast before step 0 (the recorder saw it): "
                 "each kept its own weights.", launched=True)
        if v.diagnosis in ("differs", "factor", "halved", "summed") and _gradients_broadcast(run):
            fail("broadcast-grads", f"{v.symptom.rstrip('.')}. Between backward() and the step the ranks called "
                 "broadcast, never all_reduce (the recorder's collectives): every rank applied one rank's "
                 "gradient, not the average.", launched=True)
        raise


HINTS = {
    "no-broadcast": ["Each rank seeded its own random initial weights, and nothing made them equal.",
                     "Which collective copies one rank's tensor to every other rank? (See the glossary: broadcast.)",
                     ("In start_from_the_same_weights, broadcast every parameter from rank 0; it works in place on "
                      "p.data.")],
    "wrong-start": ["The ranks agree, but on the wrong weights: which rank's weights did you copy?",
                    "The reference starts from rank 0's weights.",
                    "Broadcast with src=0."],
    "summed": ["The factor is the world size: the gradients were added up over the ranks, not averaged.",
               "What does dist.all_reduce compute by default? (Look at its `op` argument.)",
               "After the all_reduce (a sum), divide each gradient by the world size (or use op=dist.ReduceOp.AVG)."],
    "halved": ["The step is 1/world size of the reference's: the average was divided once too often.",
               "Count the divisions by the world size between backward() and optimizer.step().",
               "Sum with all_reduce, then divide once."],
    "ranks-differ": [("Some parameters were updated with a different gradient on each rank: not every gradient was "
                      "averaged."),
                     ("Print, on each rank, the norm of every parameter's gradient after average_gradients: they must "
                      "be equal on both ranks."),
                     "Loop over every parameter of the model (model.parameters()) and all_reduce each p.grad."],
    "src-differs": [
        ("Every rank called the broadcast, but each with another src: each rank sent its own weights and none "
         "received, so nothing was copied."),
        "src names the rank that sends, and it must be the same number on every rank. What is src on rank 1?",
        "dist.broadcast(p.data, src=0) on every rank."],
    "not-waited": [
        ("An asynchronous all_reduce (async_op=True) was never waited on: the step used the gradient before the sum "
         "arrived (the recorder follows every handle's wait())."),
        "async_op=True returns a handle at once; the tensor holds the sum only after handle.wait().",
        "Keep the handles, wait on each before dividing and before optimizer.step(), or call all_reduce without async_op."],
    "race": [
        ("A tensor was changed (divided) while its asynchronous all_reduce was still running: the result depends on "
         "which came first."),
        "Divide only after the handle's wait() has returned.",
        "handle = dist.all_reduce(p.grad, async_op=True); handle.wait(); p.grad /= world_size"],
    "broadcast-grads": [
        ("The gradients were broadcast, not averaged: every rank applied one rank's gradient (of its half of the "
         "batch), not the mean over the ranks."),
        "broadcast copies one rank's tensor; which collective adds up every rank's tensor?",
        "dist.all_reduce(p.grad), then p.grad /= world_size (or op=dist.ReduceOp.AVG)."],
    "hang": [("A collective was called by one rank only: the other never joined it, and the process-group timeout "
              "ended the job. The lines above show where each rank was."),
             ("Every rank must call the same collectives in the same order. Is one of your calls inside an `if` on the "
              "rank? (Notebook 03, step 5: every rank reduces, rank 0 alone prints; deep dive: 04b, section 12.)"),
             "Call all_reduce on every rank for every gradient: no condition on the rank around it."],
}


EXERCISES = [Exercise("2", "DDP by hand", "ex2_by_hand.py", check, HINTS)]
