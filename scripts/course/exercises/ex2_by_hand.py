"""Exercise 2: DDP by hand: broadcast rank 0's weights once, then average every gradient with all_reduce.

The check runs ex2_by_hand.py on 2 processes (each with its own seed, so the copies start apart) and
compares both ranks' parameters with one process on the whole batch after each of 10 steps: a sum not
divided is exactly world-size times the step, a missing broadcast shows at step 0, a collective that only
one rank calls hangs (the process-group timeout ends it).
"""

from pathlib import Path

from torch import nn

from course.exercise_tasks import mlp, regression_data
from course.exercises.reference import NPROC, Trajectory, compare_traces, simulate
from course.exercises.results import Exercise, Verdict
from course.exercises.running import failure, launch, load_traces

CONFIG = {"steps": 10, "batch": 32, "lr": 0.1, "seed": 5}  # seed 5: not the script's default
CONFIGS = (CONFIG, {"steps": 6, "batch": 16, "lr": 0.05, "seed": 9})  # the tests check both


def reference(world: int = 1, reduce: str | None = "mean") -> Trajectory:
    """world=1: one process on the whole batch; else that many simulated ranks combining gradients by ``reduce``."""
    data = regression_data(CONFIG["steps"] * CONFIG["batch"], seed=CONFIG["seed"])
    return simulate(lambda: mlp(8, 32, 32, 1), data, nn.functional.mse_loss, world=world,
                    per_rank=CONFIG["batch"] // world, steps=CONFIG["steps"], lr=CONFIG["lr"], seed=CONFIG["seed"],
                    sampler="fixed", reduce=reduce)


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--steps", CONFIG["steps"], "--batch-size", CONFIG["batch"], "--lr", CONFIG["lr"],
                        "--seed", CONFIG["seed"]], work, backend, timeout)
    failure(run, path, timeout)
    return compare_traces(load_traces(run), reference(), "every step", loss_ref=reference(NPROC),
                          seconds=run.seconds)


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
    "hang": [("A collective was called by one rank only: the other never joined it, and the process-group timeout "
              "ended the job. The lines above show where each rank was."),
             ("Every rank must call the same collectives in the same order. Is one of your calls inside an `if` on the "
              "rank? (Notebook 04, section 12.)"),
             "Call all_reduce on every rank for every gradient: no condition on the rank around it."],
}


EXERCISES = [Exercise("2", "DDP by hand", "ex2_by_hand.py", check, HINTS)]
