"""Exercise 1: convert a single-device script (ex1_single.py, waveforms and a 1-D CNN) to DDP.

The check runs the learner's ex1_convert.py on 2 processes with a per-process batch of 16 and a seed that
is not the default, and requires what the single-device run at batch 32 gives: every logged loss (of the
global batch), the checkpoint's parameters (no ``module.`` prefix), one writer of the log and of the
checkpoint (the recorder sees who opens them), and exact validation counts (301 samples, each once).
"""

import json
import math
from pathlib import Path

import torch
from torch import nn

from course.exercise_tasks import WaveNet, wave_datasets
from course.exercises.reference import (
    NPROC,
    TOLERANCE,
    Trajectory,
    close,
    constant_ratio,
    maxdiff,
    simulate,
    wave_val,
)
from course.exercises.results import Exercise, Verdict, fail, rel
from course.exercises.running import failure, launch

CONFIG = {"epochs": 3, "per_rank": 16, "lr": 0.5, "momentum": 0.9, "seed": 3}  # seed 3: not the default 0
CONFIGS = (CONFIG, {"epochs": 2, "per_rank": 8, "lr": 0.3, "momentum": 0.9, "seed": 11})  # the tests check both


def reference(world: int = 1, **changes) -> Trajectory:
    """world=1: the single-device script at the global batch; world=NPROC: simulated ranks (for the hints)."""
    train, val = wave_datasets()
    cfg = {**CONFIG, **changes}
    per_rank = cfg.pop("per_rank") * (NPROC if world == 1 else 1)
    return simulate(WaveNet, train, nn.functional.cross_entropy, world=world, per_rank=per_rank, val=val,
                    val_fn=wave_val, **cfg)


def _train_sharded(run, n_train: int) -> bool:
    """Whether a DistributedSampler gave the ranks their shares of the training set (the recorder saw it)."""
    share = math.ceil(n_train / NPROC)
    return any(len(s["indices"]) == share for rec in run.records.values() for s in rec["samplers"])


def _check_losses(run, losses: list, ref: Trajectory) -> None:
    n = len(ref.losses)
    first = next(i for i, (a, b) in enumerate(zip(losses, ref.losses)) if not close(a, b))
    symptom = (f"the logged loss differs from the single-device run from step {first} on "
               f"(yours {losses[first]:.6f}, reference {ref.losses[first]:.6f}; tolerance {TOLERANCE})")
    factor = constant_ratio(losses, ref.losses)
    if factor == NPROC:
        fail("loss-summed", symptom + f": every one is exactly {NPROC}× (the world size) the reference's.",
             launched=True)
    if factor == 1 / NPROC:
        fail("loss-halved", symptom + f": every one is exactly 1/{NPROC} of the reference's.", launched=True)
    if close(losses, [r[0] for r in reference(world=NPROC).rank_losses]):
        fail("local-loss", symptom + ": your numbers are rank 0's own loss, of half the batch.", launched=True)
    if CONFIG["seed"] != 0 and close(losses, reference(world=NPROC, order_seed=0).losses):
        fail("sampler-seed", symptom + f": your numbers are those of a data order drawn with seed 0, the "
             f"sampler's default (the check passes --seed {CONFIG['seed']}).", launched=True)
    if close(losses, reference(world=NPROC, set_epoch=False).losses):
        per_epoch = n // CONFIG["epochs"]
        fail("no-set-epoch", symptom + f"; steps 0-{per_epoch - 1} (epoch 0) match, and from step {per_epoch} "
             "on your numbers are those of a run whose every epoch repeats epoch 0's order.", launched=True)
    alone = reference(world=NPROC, reduce=None)
    if close(losses, [r[0] for r in alone.rank_losses]) or close(losses, alone.losses):
        fail("not-averaged", symptom + "; your numbers are those of ranks that each train alone on their "
             "own half, never sharing gradients.", launched=True)
    _check_data(run, symptom, first)
    fail("loss-differs", symptom + ".", launched=True)


def _check_data(run, symptom: str, first: int) -> None:
    """What each rank's DistributedSampler yielded (the recorder saw it) against what the check's seed gives:
    none read the training set (a split by hand), an order not shuffled, or the right samples with a first loss
    that still differs (the loss itself is computed differently)."""
    from torch.utils.data import DistributedSampler

    train = wave_datasets()[0]
    share = math.ceil(len(train) / NPROC)
    seen = {r: [s["indices"] for s in rec["samplers"] if len(s["indices"]) == share]
            for r, rec in sorted(run.records.items())}
    if not any(seen.values()):
        fail("hand-split", symptom + ": no DistributedSampler read the training set (the recorder saw none), so the "
             "ranks' batches are not the single-device run's batches split between them.", launched=True)
    ordered = {r: list(range(len(train)))[r::NPROC] for r in seen}
    if any(lists and lists[0] == ordered[r] for r, lists in seen.items()):
        rank = next(r for r, lists in seen.items() if lists and lists[0] == ordered[r])
        fail("no-shuffle", symptom + f": rank {rank}'s sampler yielded its share in the data set's own order "
             f"({ordered[rank][:4]}...), not shuffled.", launched=True)
    want = {r: list(DistributedSampler(train, num_replicas=NPROC, rank=r, seed=CONFIG["seed"])) for r in seen}
    if first == 0 and all(lists and lists[0] == want[r] for r, lists in seen.items()):
        fail("first-loss", symptom + ": already the first loss, though every rank's sampler yielded the samples "
             "the single-device run's first epoch splits between them.", launched=True)


def _check_validation(vals: list, ref: Trajectory) -> tuple[int, int]:
    if len(vals) != 1:
        fail("val-missing", f"the log has {len(vals)} validation records; it should end with exactly one.",
             launched=True)
    correct, total = vals[0]["val_correct"], vals[0]["val_total"]
    ref_correct, ref_total = ref.val
    if total != ref_total:
        cases = {ref_total * NPROC: ("val-twice", "every sample was counted twice: each rank evaluated the whole set"),
                 math.ceil(ref_total / NPROC) * NPROC: ("val-padded", ("one sample was counted twice: the split was "
                                                                      "padded to equal shares")),
                 ref_total // NPROC * NPROC: ("val-dropped", ("the last sample was dropped to give the ranks equal "
                                                            "shares; the ranks' counts were added up")),
                 math.ceil(ref_total / NPROC): ("val-partial", "only rank 0's part was counted"),
                 ref_total // NPROC: ("val-partial", "only one rank's part was counted")}
        diag, why = cases.get(total, ("val-partial" if total < ref_total else "val-count", ""))
        fail(diag, f"validation counted {total} samples, the validation set has {ref_total}"
             + (f": {why}." if why else "."), launched=True)
    if correct != ref_correct:
        fail("val-count", f"validation: {correct}/{total} correct, the single-device model gets "
             f"{ref_correct}/{ref_total}.", launched=True)
    return correct, total


def check(path: Path, work: Path, *, backend: str, timeout: float) -> Verdict:
    run = launch(path, ["--epochs", CONFIG["epochs"], "--batch-size", CONFIG["per_rank"], "--lr", CONFIG["lr"],
                        "--seed", CONFIG["seed"]], work, backend, timeout)
    failure(run, path, timeout)
    log, ckpt = work / "log.jsonl", work / "model.pt"
    writers = {f: sorted(r for r, rec in run.records.items() if str(f.resolve()) in rec["writes"])
               for f in (log, ckpt)}

    def one_writer():
        for f, ranks in writers.items():
            if len(ranks) > 1:
                fail("every-rank-writes", f"{f.name} was written by {len(ranks)} processes (ranks "
                     f"{', '.join(map(str, ranks))}): they overwrite each other's file.", launched=True)

    for f, ranks in writers.items():
        if not ranks or not f.exists():
            fail("no-output", f"no process wrote {f.name} in the --out folder ({rel(work)}).", launched=True)
    try:  # the numbers first (the training itself); who writes comes after, unless the log is torn
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except ValueError:
        one_writer()
        fail("log-unreadable", f"{log.name} is not one JSON record per line.", launched=True)
    steps = [r for r in records if "loss" in r]
    ref = reference()
    n = len(ref.losses)
    if len(steps) != n:
        facts = (f"the log has {len(steps)} steps, the single-device run {n} ({CONFIG['epochs']} epochs of global "
                 f"batches of {CONFIG['per_rank'] * NPROC})")
        if len(steps) == 2 * n and _train_sharded(run, len(wave_datasets()[0])):
            fail("batch-halved", f"{facts}: each rank read its own half of the training set, so its batches held "
                 f"{CONFIG['per_rank'] // 2} samples, not {CONFIG['per_rank']}.", launched=True)
        if len(steps) == 2 * n:
            fail("no-sharding", f"{facts}: each process went through the whole training set.", launched=True)
        fail("steps", f"{facts}.", launched=True)
    losses = [r["loss"] for r in steps]
    if not close(losses, ref.losses):
        _check_losses(run, losses, ref)
    one_writer()
    state = torch.load(ckpt, weights_only=True)
    keys = list(state)
    if any(k.startswith("module.") for k in keys):
        fail("module-prefix", f"the checkpoint's keys start with `module.` ({keys[0]}): a single-device "
             "WaveNet cannot load it as it is.", launched=True)
    if keys != ref.names or not all(close(state[k], p) for k, p in zip(keys, ref.params[-1])):
        fail("params-differ", f"the checkpoint's parameters are not those of the single-device run after {n} steps "
             f"(keys {keys[:3]}...).", launched=True)
    correct, total = _check_validation([r for r in records if "val_total" in r], ref)
    loss_diff = maxdiff(losses, ref.losses)
    param_diff = max(maxdiff(state[k], p) for k, p in zip(keys, ref.params[-1]))
    writer = writers[log][0]
    return Verdict("pass", "pass", f"{n} steps on {NPROC} processes × {CONFIG['per_rank']} = the single-device "
                   f"run's batch of {CONFIG['per_rank'] * NPROC} (seed {CONFIG['seed']}): every logged loss and the "
                   f"final parameters equal (max |Δ| {loss_diff:.1e} and {param_diff:.1e}; {TOLERANCE}); log and "
                   f"checkpoint written by rank {writer} only; validation {correct}/{total}, each sample counted once.",
                   {"launched": True, "seconds_run": round(run.seconds, 1)})


HINTS = {
    "no-output": ["The script must still write log.jsonl and model.pt into --out (one process writes them)."],
    "every-rank-writes": ["Two processes writing one file overwrite each other (and can leave a torn file).",
                          "Which variable tells a process whether it is the first one? Use it to choose who writes.",
                          ("Put the writing (log and checkpoint) under `if rank == 0:` — every rank still computes what "
                           "it writes, only one writes it.")],
    "no-sharding": [("With N processes each step sees N per-process batches: the processes must split the data, "
                     "not each read all of it."),
                    "Which sampler gives each process its own part of the data set? (Notebook 03, step 4.)",
                    ("Replace the RandomSampler by a DistributedSampler(train_set, seed=args.seed); its order is the "
                     "single-device script's order, split between the ranks.")],
    "batch-halved": [("The data is split between the ranks, yet each epoch has twice the steps: each step's batch "
                      "is half what it should be."),
                     ("--batch-size is per process: 2 processes x 16 make the single-device batch of 32. Print "
                      "len(x) in your loop."),
                     "Pass args.batch_size to the DataLoader as it is: do not divide it by the world size."],
    "sampler-seed": [("Your numbers are those of a run whose data order uses seed 0 (the default), while the check "
                      "passes another --seed."),
                     "The sampler has its own seed argument: which seed does yours use?",
                     "DistributedSampler(train_set, seed=args.seed)."],
    "loss-summed": [("Every logged loss is exactly the world size times the reference's: the ranks' losses were "
                     "added up, not averaged."),
                    "all_reduce sums by default: what is left to do after it?",
                    "Divide the all-reduced loss by the world size (or all_reduce with op=dist.ReduceOp.AVG)."],
    "loss-halved": [("Every logged loss is exactly 1 / the world size of the reference's: the mean was divided by "
                     "the world size once too often."),
                    "Count the divisions by the world size between the all_reduce and the log.",
                    "ReduceOp.AVG already divides: with it, do not divide again."],
    "steps": ["Count the steps: an epoch of 512 samples with 2 processes × 16 per step is 16 steps."],
    "local-loss": ["Each rank's loss is the loss of its own part of the global batch.",
                   ("To log the loss of the whole global batch, every rank must contribute its loss: which collective "
                    "combines one number from every rank?"),
                   "all_reduce a copy of the loss (detached) and divide by the world size before logging it."],
    "no-set-epoch": ["Epoch 0 matches; epoch 1 does not: the order of epoch 1 is not the single-device run's.",
                     ("The single-device script reseeds its order every epoch (seed + epoch). What does "
                      "DistributedSampler need to know to do the same?"),
                     "Call sampler.set_epoch(epoch) at the start of every epoch."],
    "not-averaged": ["Each rank trained on its own: the gradients were never averaged between the ranks.",
                     "What makes the ranks average their gradients in backward()? (Notebook 03, step 3.)",
                     "Wrap the model in DistributedDataParallel after moving it to the device."],
    "hand-split": [("No DistributedSampler split the training set (the recorder saw none): a split made by hand "
                    "does not give the single-device run's batches, a seeded permutation dealt out to the ranks."),
                   ("The single-device script shuffles with seed + epoch; DistributedSampler(train_set, seed=args.seed) "
                    "shuffles the same way and gives rank r every world_size-th index, so that a step's batches "
                    "together are the single-device batch."),
                   ("sampler = DistributedSampler(train_set, seed=args.seed); DataLoader(train_set, args.batch_size, "
                    "sampler=sampler); sampler.set_epoch(epoch) at the start of each epoch.")],
    "no-shuffle": [("Each rank read its share in the data set's own order: the sampler does not shuffle, while the "
                    "single-device run draws a seeded random order each epoch."),
                   "DistributedSampler shuffles unless told not to: which shuffle= does yours get?",
                   "DistributedSampler(train_set, seed=args.seed) (shuffle=True, its default)."],
    "first-loss": [("Already the first logged loss differs, though every rank read the right samples (the recorder "
                    "saw them): the same weights on the same batch give another loss, so the loss is computed "
                    "differently."),
                   ("Compare the loss with the single-device script's: the criterion and its arguments (reduction, "
                    "label_smoothing, weights), and what you log."),
                   "Keep criterion = nn.CrossEntropyLoss() (the mean over the batch) and log its mean over the ranks."],
    "loss-differs": ["Compare your step loop with the single-device one, line by line: what else changed?",
                     "Run both scripts and print the first 3 losses of each.",
                     ("The global batch of step k must be the single-device batch of step k: same sampler seed, "
                      "per-process batch 16 (the check passes --batch-size 16).")],
    "module-prefix": ["A DDP-wrapped model's state_dict has every key prefixed with `module.`.",
                      "Save the state_dict of the model inside the wrapper, not of the wrapper.",
                      "Save model.module.state_dict()."],
    "params-differ": ["The logged losses match but the saved parameters do not: are you saving the model after training?"],
    "val-padded": ["301 samples cannot be split evenly between 2 ranks. What does DistributedSampler do then?",
                   "DistributedSampler pads by repeating samples: fine for training, wrong for counting.",
                   ("Give each rank every world_size-th validation sample without padding: "
                    "Subset(val_set, range(rank, len(val_set), world_size)).")],
    "val-twice": ["Every rank evaluated the whole validation set, and the counts were summed.",
                  "Split the validation set between the ranks too.",
                  "Subset(val_set, range(rank, len(val_set), world_size)) gives each rank its own part."],
    "val-partial": ["The count covers only part of the validation set.",
                    "Each rank counted its own part; which collective adds them up?",
                    "all_reduce the [correct, total] tensor before reading it."],
    "val-dropped": [("One sample is missing: 301 = 2 x 150 + 1, and the last one was dropped to give both ranks "
                     "equal shares (drop_last). Your all_reduce is fine."),
                    "DistributedSampler(drop_last=True) cuts the tail; without it, it pads by repeating samples.",
                    ("Give each rank every world_size-th validation sample, without padding or cutting: "
                     "Subset(val_set, range(rank, len(val_set), world_size)).")],
    "val-count": ["The validation counts do not add up to the set: each sample must be counted exactly once."],
    "val-missing": [("End the log with exactly one {'val_correct': ..., 'val_total': ...} record, as the "
                     "single-device script does.")],
}


EXERCISES = [Exercise("1", "Convert a script to DDP", "ex1_convert.py", check, HINTS)]
