"""Exercise 6: the debugging lab: three broken DDP scripts (a hang, the same order every epoch, a step too
large with gradient accumulation). As committed, each check runs the broken script and shows its symptom;
it passes only when the fixed script behaves right: it finishes, and its numbers equal one process's.
"""

from pathlib import Path

from torch import nn

from course.exercise_tasks import lab_datasets, mlp
from course.exercises.reference import NPROC, Trajectory, close, compare_traces, mse_val, simulate
from course.exercises.results import Exercise, Stop, Verdict, fail
from course.exercises.running import failure, launch, load_metrics, load_traces

CONFIG = {"epochs": 2, "per_rank": 16, "lr": 0.05, "seed": 2}  # seeds: not the scripts' default
CONFIG_C = {"per_rank": 8, "accum": 4, "steps": 4, "lr": 0.05, "seed": 2}  # 4 steps x 2 ranks x 4 x 8 = 256 samples


def reference(world: int = 1, **changes) -> Trajectory:
    train, val = lab_datasets()
    cfg = {**CONFIG, **changes}
    per_rank = cfg.pop("per_rank") * (NPROC if world == 1 else 1)
    return simulate(lambda: mlp(8, 32, 1), train, nn.functional.mse_loss, world=world, per_rank=per_rank,
                     val=val, val_fn=mse_val, momentum=0.9, **cfg)


def check_hang(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--epochs", CONFIG["epochs"], "--batch-size", CONFIG["per_rank"], "--lr", CONFIG["lr"],
                        "--seed", CONFIG["seed"]], work, backend, timeout)
    failure(run, path, timeout)
    metrics = load_metrics(run)
    ref_sum, ref_total = reference().val
    last = metrics["val"][-1]
    if len(metrics["val"]) != CONFIG["epochs"]:
        fail("val-missing", f"metrics.json has {len(metrics['val'])} validation results, one per epoch "
              f"({CONFIG['epochs']}) expected.", launched=True)
    if last["count"] != ref_total:
        fail("val-partial" if last["count"] < ref_total else "val-count",
              f"the job finishes, but validation counts {last['count']} samples of {ref_total}.", launched=True)
    if not close(last["mse"], ref_sum / ref_total):
        fail("val-differs", f"the job finishes, but the last validation MSE is {last['mse']:.6f}; one process on "
              f"the same global batches gets {ref_sum / ref_total:.6f}.", launched=True)
    return Verdict("pass", "pass", f"the job finishes in {run.seconds:.0f} s; validation after each of the "
                   f"{CONFIG['epochs']} epochs over all {ref_total} samples, final MSE {last['mse']:.5f} = the "
                   "single-process run's.", {"launched": True})


def check_epochs(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    epochs = 3
    run = launch(path, ["--epochs", epochs, "--batch-size", CONFIG["per_rank"], "--lr", CONFIG["lr"],
                        "--seed", CONFIG["seed"]], work, backend, timeout)
    failure(run, path, timeout)
    for rank, rec in sorted(run.records.items()):
        seen = [s for s in rec["samplers"] if len(s["indices"]) == len(lab_datasets()[0]) // NPROC]
        if len(seen) < epochs:
            fail("sampler", f"rank {rank} iterated its training sampler {len(seen)} times for {epochs} epochs.",
                  launched=True)
        for e in range(1, epochs):
            if seen[e]["indices"] == seen[e - 1]["indices"]:
                fail("same-order", f"the job runs, but epoch {e} gave rank {rank} exactly the same {len(seen[e]['indices'])} "
                      f"samples in the same order as epoch {e - 1} ({seen[e]['indices'][:5]}...; the check records "
                      "what each rank's DistributedSampler yields).", launched=True)
    ref = reference(epochs=epochs)
    verdict = compare_traces(load_traces(run), ref, "a new order each epoch", seconds=run.seconds)
    verdict.symptom = (f"every epoch gives each rank a new order; after {epochs} epochs "
                       + verdict.symptom.split(": ", 1)[1])
    return verdict


def reference_c(accum=None, loss_scale=1.0) -> Trajectory:
    train, _ = lab_datasets()
    return simulate(lambda: mlp(8, 32, 1), train, nn.functional.mse_loss, per_rank=CONFIG_C["per_rank"] * NPROC,
                     accum=accum or CONFIG_C["accum"], steps=CONFIG_C["steps"], lr=CONFIG_C["lr"], seed=CONFIG_C["seed"],
                     loss_scale=loss_scale, epochs=1)


def check_accumulation(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--steps", CONFIG_C["steps"], "--batch-size", CONFIG_C["per_rank"], "--accum",
                        CONFIG_C["accum"], "--lr", CONFIG_C["lr"], "--seed", CONFIG_C["seed"]], work, backend, timeout)
    failure(run, path, timeout)
    ref = reference_c()
    try:
        verdict = compare_traces(load_traces(run), ref, f"{CONFIG_C['accum']} micro-batches of {CONFIG_C['per_rank']} "
                                 "per rank per step", seconds=run.seconds)
    except Stop as stop:
        v = stop.verdict
        if v.diagnosis in ("differs", "summed", "factor") and abs(v.facts.get("ratio", 0) - CONFIG_C["accum"]) < 0.05 * CONFIG_C["accum"]:
            v.diagnosis = "accum-not-divided"
            v.symptom = (f"the job runs, but after step {v.facts['step']} the parameters moved {v.facts['ratio']:.2f}× "
                         f"as far as one process's step on the same {CONFIG_C['per_rank'] * NPROC * CONFIG_C['accum']} samples.")
        raise
    return verdict


HINTS_A = {
    "hang": [("The job hangs: one rank waits in a collective, the other waits somewhere else. The lines above show "
              "where each rank was when the timeout ended it."),
             ("Two ranks waiting in two *different* collectives is the signature of a collective that only some ranks "
              "call. Follow the waiting rank's line up to the code that called it: is that code run by every rank? "
              "(Notebook 04, section 12; `py-spy dump --pid PID` shows the same for a live job.)"),
             ("evaluate() contains an all_reduce, and only rank 0 calls evaluate(). Every rank must evaluate its own "
              "part; only the printing and saving belong to rank 0.")],
    "val-partial": ["The job finishes now, but the validation counts only part of the set.",
                    "Each rank evaluates its own part: the parts must be added up on every rank.",
                    "Call evaluate() (with its all_reduce) on every rank; print on rank 0."],
    "val-differs": ["The job finishes, but the validation number is not the single-process one.",
                    "Evaluate after the same training on every rank, with each rank's own part summed."],
    "no-output": ["Rank 0 must still write metrics.json (the check reads the validation results from it)."],
}

HINTS_B = {
    "sampler": ["Keep the training loop reading its DistributedSampler once per epoch: the check records what it yields."],
    "same-order": [("Every epoch shows each rank exactly the same samples in the same order: the model sees one "
                    "fixed order over and over."),
                   ("Print the first indices of each rank's sampler in every epoch (list(sampler)[:5], notebook 04 "
                    "section 2). When does the sampler's epoch change?"),
                   ("DistributedSampler shuffles with seed + epoch; its epoch is what you last passed to set_epoch. "
                    "Look at *where* set_epoch is called, relative to the loop that reads the data.")],
    "differs": [("The order changes now, but the run is not the reference's: each epoch e must use the order of "
                 "DistributedSampler's epoch e."),
                "Call sampler.set_epoch(epoch) before the loop over the data of that epoch."],
}

HINTS_C = {
    "accum-not-divided": [("The factor is also the number of accumulation steps (--accum 4): something adds up once "
                           "per micro-batch."),
                          ("backward() adds to .grad. Compare the gradient after 4 micro-batches with the gradient "
                           "of one batch of the same 4× size (notebook 04 section 13 compares steps like this)."),
                          ("Each micro-batch's loss is a mean over its samples; the 4 backward() calls add 4 means. "
                           "Divide each micro-batch's loss by the number of accumulation steps before backward().")],
}


EXERCISES = [Exercise("6a", "Debugging lab: a hang", "ex6a_debug.py", check_hang, HINTS_A),
             Exercise("6b", "Debugging lab: the same every epoch", "ex6b_debug.py", check_epochs, HINTS_B),
             Exercise("6c", "Debugging lab: a step too large", "ex6c_debug.py", check_accumulation, HINTS_C)]
