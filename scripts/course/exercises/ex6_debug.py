"""Exercise 6: the debugging lab: three broken DDP scripts (a hang, the same order every epoch, a step too
large with gradient accumulation). As committed, each check runs the broken script and shows its symptom
only, as a bug report would; what the check measured that points at the cause (where each rank waited,
what each rank's sampler yielded, the factor of the step) is the second rung of the hint ladder
(``{detail}`` in a hint: ``hint("6a")`` shows it). It passes only when the fixed script behaves right: it
finishes, and its numbers equal one process's.
"""

from pathlib import Path

from torch import nn

from course.exercise_tasks import lab_datasets, mlp
from course.exercises.reference import NPROC, Trajectory, close, compare_traces, mse_val, simulate
from course.exercises.results import Exercise, Stop, Verdict, fail
from course.exercises.running import PG_TIMEOUT_S, failure, launch, load_metrics, load_traces

CONFIG = {"epochs": 2, "per_rank": 16, "lr": 0.05, "seed": 2}  # seeds: not the scripts' default
CONFIG_C = {"per_rank": 8, "accum": 4, "steps": 4, "lr": 0.05, "seed": 2}  # 4 steps x 2 ranks x 4 x 8 = 256 samples
CONFIGS = (CONFIG, {"epochs": 3, "per_rank": 8, "lr": 0.02, "seed": 5})  # the tests check both
CONFIGS_C = (CONFIG_C, {"per_rank": 4, "accum": 2, "steps": 3, "lr": 0.1, "seed": 6})


def reference(world: int = 1, **changes) -> Trajectory:
    train, val = lab_datasets()
    cfg = {**CONFIG, **changes}
    per_rank = cfg.pop("per_rank") * (NPROC if world == 1 else 1)
    return simulate(lambda: mlp(8, 32, 1), train, nn.functional.mse_loss, world=world, per_rank=per_rank,
                     val=val, val_fn=mse_val, momentum=0.9, **cfg)


def _args(epochs: int) -> list:
    return ["--epochs", epochs, "--batch-size", CONFIG["per_rank"], "--lr", CONFIG["lr"], "--seed", CONFIG["seed"]]


def check_hang(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, _args(CONFIG["epochs"]), work, backend, timeout)
    try:
        failure(run, path, timeout)
    except Stop as stop:
        v = stop.verdict
        if v.diagnosis == "hang" and v.facts.get("detail"):  # the symptom only; where each rank was: hint 2
            ended = (f"it was still running after {timeout:.0f} s and was stopped" if run.returncode is None else
                     f"it stopped making progress until the {PG_TIMEOUT_S} s process-group timeout ended it")
            v.symptom = f"the job hung: {ended} (hint('6a') shows where each rank was)."
        raise
    metrics = load_metrics(run)
    ref_sum, ref_total = reference().val
    last = metrics["val"][-1]
    if len(metrics["val"]) != CONFIG["epochs"]:
        fail("val-missing", f"metrics.json has {len(metrics['val'])} validation results, one per epoch "
              f"({CONFIG['epochs']}) expected.", launched=True)
    if last["count"] != ref_total:
        diagnosis = {NPROC * ref_total: "val-twice"}.get(last["count"], "val-partial" if last["count"] < ref_total
                                                         else "val-count")
        fail(diagnosis, f"the job finishes, but validation counts {last['count']} samples of {ref_total}.", launched=True)
    if not close(last["mse"], ref_sum / ref_total):
        fail("val-differs", f"the job finishes, but the last validation MSE is {last['mse']:.6f}; one process on "
              f"the same global batches gets {ref_sum / ref_total:.6f}.", launched=True)
    return Verdict("pass", "pass", f"the job finishes in {run.seconds:.0f} s; validation after each of the "
                   f"{CONFIG['epochs']} epochs over all {ref_total} samples, final MSE {last['mse']:.5f} = the "
                   "single-process run's.", {"launched": True})


def _first_step_off(traces: list[dict], ref: Trajectory) -> int | None:
    """The first step after which rank 0's parameters leave the reference's, if they do."""
    for k, (mine, want) in enumerate(zip(traces[0]["params"], ref.params)):
        if not all(close(a, b) for a, b in zip(mine, want)):
            return k
    return None


def check_epochs(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    epochs = CONFIG["epochs"] + 1
    run = launch(path, _args(epochs), work, backend, timeout)
    failure(run, path, timeout)
    ref = reference(epochs=epochs)
    per_epoch = len(lab_datasets()[0]) // NPROC
    for rank, rec in sorted(run.records.items()):
        seen = [s for s in rec["samplers"] if len(s["indices"]) == per_epoch]
        if len(seen) < epochs:
            fail("sampler", f"rank {rank} iterated its training sampler {len(seen)} times for {epochs} epochs.",
                  launched=True)
        for e in range(1, epochs):
            if seen[e]["indices"] == seen[e - 1]["indices"]:
                k = _first_step_off(load_traces(run), ref)
                fail("same-order", "the job runs, but the parameters leave the single-process run's path "
                     + (f"after step {k}, " if k else "") + f"in epoch {e}; epoch {e - 1} matched (hint('6b') shows "
                     "what the check recorded).", launched=True,
                     detail=f"epoch {e} gave rank {rank} exactly the same {len(seen[e]['indices'])} samples in the "
                            f"same order as epoch {e - 1} ({seen[e]['indices'][:5]}...).")
    traces = load_traces(run)
    try:
        verdict = compare_traces(traces, ref, "a new order each epoch", seconds=run.seconds)
    except Stop as stop:
        default_seed = reference(epochs=epochs, order_seed=0).params[-1]
        if stop.verdict.diagnosis == "differs" and all(close(a, b) for a, b in zip(traces[0]["params"][-1],
                                                                                     default_seed)):
            fail("sampler-seed", f"{stop.verdict.symptom[:-1]}: every epoch has a new order, but the one a sampler "
                 f"seeded with 0 (its default) gives; the check passes --seed {CONFIG['seed']}.", launched=True)
        raise
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
    try:
        return compare_traces(load_traces(run), reference_c(), f"{CONFIG_C['accum']} micro-batches of "
                              f"{CONFIG_C['per_rank']} per rank per step", seconds=run.seconds)
    except Stop as stop:
        v, accum = stop.verdict, CONFIG_C["accum"]
        if v.diagnosis == "ranks-differ":  # DDP averages in the backward run outside no_sync(): that one was not
            fail("unsynced", f"{v.symptom.rstrip('.')}: DDP did not average the gradients that the step applied "
                 "(its all-reduce runs in a backward outside no_sync() only).", launched=True)
        if v.diagnosis in ("differs", "summed", "factor") and abs(v.facts.get("ratio", 0) - accum) < 0.05 * accum:
            v.diagnosis = "accum-not-divided"
            v.symptom = (f"the job runs, but after step {v.facts['step']} the parameters are far from one process's "
                         f"step on the same {CONFIG_C['per_rank'] * NPROC * accum} samples: each step goes too far "
                         "(hint('6c') shows by how much).")
            v.facts["detail"] = (f"the step moved the parameters {v.facts['ratio']:.2f}× as far as one process's step "
                                 "from the same point.")
        raise


HINTS_A = {
    "hang": [("The job hangs: one rank waits in a collective, the other waits somewhere else. Find where each rank "
              "was when the timeout ended it: hint('6a') shows it."),
             ("Where each rank was: {detail} Two ranks waiting in two *different* collectives is the signature of a "
              "collective that only some ranks call. Follow the waiting rank's line up to the code that called it: is "
              "that code run by every rank? (Notebook 03, step 5: every rank reduces, rank 0 alone writes; deep dive: "
              "04b, section 12; `py-spy dump --pid PID` shows the same for a "
              "live job.)"),
             ("evaluate() contains an all_reduce, and only rank 0 calls evaluate(). Every rank must evaluate its own "
              "part; only the printing and saving belong to rank 0.")],
    "val-partial": ["The job finishes now, but the validation counts only part of the set.",
                    "Each rank evaluates its own part: the parts must be added up on every rank.",
                    "Call evaluate() (with its all_reduce) on every rank; print on rank 0."],
    "val-twice": ["The job finishes, but every validation sample was counted once per rank.",
                  "Each rank evaluates the data its val_loader gives it, and evaluate() adds the ranks' counts up.",
                  "Give each rank its own part: Subset(val_set, range(rank, len(val_set), world_size)), as committed."],
    "val-differs": [("The job finishes, but the validation number is not the single-process one: the ranks' parts "
                     "must be combined as one mean over every sample."),
                    ("A mean of the ranks' means is not the mean over all samples when the parts differ in size (301 "
                     "= 151 + 150): add up the sums and the counts, then divide."),
                    "Evaluate after the same training on every rank; all_reduce [sum of errors, count], then divide."],
    "no-output": ["Rank 0 must still write metrics.json (the check reads the validation results from it)."],
    "val-missing": ["Rank 0 must still validate after every epoch and write each result into metrics.json."],
}

HINTS_B = {
    "sampler": ["Keep the training loop reading its DistributedSampler once per epoch: the check records what it yields."],
    "same-order": [("Epoch 0 follows the single-process run and the next epoch does not. What changes from one epoch "
                    "to the next? hint('6b') shows what the check recorded."),
                   ("The check recorded what each rank's DistributedSampler yields: {detail} Print the first indices "
                    "of each rank's sampler in every epoch (list(sampler)[:5], notebook 04 section 2). When does the "
                    "sampler's epoch change?"),
                   ("DistributedSampler shuffles with seed + epoch; its epoch is what you last passed to set_epoch. "
                    "Look at *where* set_epoch is called, relative to the loop that reads the data.")],
    "differs": [("The order changes now, but the run is not the reference's: each epoch e must use the order of "
                 "DistributedSampler's epoch e."),
                "Call sampler.set_epoch(epoch) before the loop over the data of that epoch, with that epoch's number."],
    "sampler-seed": ["Every epoch has a new order, but not the one seeded with --seed: the sampler kept its default seed.",
                     "DistributedSampler has its own seed argument (default 0): which seed does the script give it?",
                     "DistributedSampler(train_set, seed=args.seed)."],
}

HINTS_C = {
    "accum-not-divided": [("Measure by how much each step goes too far: compare one step with one process's step "
                           "from the same point (notebook 03's proof 1 compares gradients like this; deep dive: "
                           "05, section 2, accumulation); hint('6c') shows "
                           "what the check measured."),
                          ("{detail} The factor is also the number of accumulation steps (--accum 4): something adds "
                           "up once per micro-batch. backward() adds to .grad: compare the gradient after 4 "
                           "micro-batches with the gradient of one batch of the same 4× size."),
                          ("Each micro-batch's loss is a mean over its samples; the 4 backward() calls add 4 means. "
                           "Divide each micro-batch's loss by the number of accumulation steps before backward().")],
    "unsynced": [("The ranks differ after a step: DDP did not average the gradients before optimizer.step(), "
                  "because the last micro-batch ran under no_sync() (DDP all-reduces only in a backward outside it)."),
                 ("model.no_sync() turns DDP's all-reduce off for the backward inside it (and it is read in the "
                  "forward). Which micro-batch's forward and backward run outside it? Print `last` for each micro."),
                 ("Run the last micro-batch (micro == args.accum - 1) outside no_sync(), forward and backward; every "
                  "earlier one inside it.")],
    "halved": [("Each step is half one process's step: something divides by the world size, and DDP already "
                "averages the gradients over the ranks."),
               "Which divisions stand between the micro-batch loss and optimizer.step()?",
               "Divide each micro-batch's loss by args.accum only: (loss / args.accum).backward()."],
    "differs": [("The step is not a clean multiple of one process's step: not every micro-batch's gradient is in "
                 ".grad when the optimizer steps."),
                "Where are the gradients cleared: once per optimizer step, or once per micro-batch?",
                "optimizer.zero_grad() once, before the loop over the micro-batches; optimizer.step() after it."],
}


EXERCISES = [Exercise("6a", "Debugging lab: a hang", "ex6a_debug.py", check_hang, HINTS_A),
             Exercise("6b", "Debugging lab: the same every epoch", "ex6b_debug.py", check_epochs, HINTS_B),
             Exercise("6c", "Debugging lab: a step too large", "ex6c_debug.py", check_accumulation, HINTS_C)]
