"""Exercises 1, 2, 4, 5 and 6 launched on 2 gloo processes: each realistic mistake fails with its own
diagnosis and first hint, correct alternatives pass, the debugging lab's scripts as committed show their
symptom. One real torchrun job per mistake or alternative (about 8 s each on an idle 2-core box), checked two at
a time: each check has its own script, work folder and results file, and no diagnosis depends on how fast a
job runs (they come from what the recorder saw; a hang ends at the process-group timeout whatever the load)."""

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import executed_notebook, wait_for_no_processes
from exercise_helpers import mutate

from course import RUNS, SCRIPTS
from course.exercises import EXERCISES, NOTEBOOK, check, ex1_convert, ex2_by_hand

WAIT_EVERY = "        for handle, flat, i in self.pending:\n            handle.wait()\n"

LAUNCHED_MISTAKES = {
    ("1", "every-rank-writes"): [("    if rank == 0:  # DDP step 5: one process writes", "    if True:  # every rank")],
    ("1", "local-loss"): [("global_loss = summed.item() / world_size", "global_loss = loss.item()")],
    ("1", "loss-summed"): [("global_loss = summed.item() / world_size", "global_loss = summed.item()")],
    ("1", "sampler-seed"): [("DistributedSampler(train_set, seed=args.seed)", "DistributedSampler(train_set)")],
    ("1", "batch-halved"): [("DataLoader(train_set, args.batch_size, sampler=sampler)",
                             "DataLoader(train_set, args.batch_size // world_size, sampler=sampler)")],
    ("1", "val-padded"): [("DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 100)",
                           "DataLoader(val_set, 100, sampler=DistributedSampler(val_set, shuffle=False))")],
    ("1", "val-dropped"): [("DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 100)",
                            ("DataLoader(val_set, 100, sampler=DistributedSampler(val_set, shuffle=False, "
                            "drop_last=True))"))],
    ("2", "summed"): [("        p.grad /= world_size\n", "")],
    ("2", "no-broadcast"): [("        dist.broadcast(p.data, src=0)", "        pass")],
    ("2", "hang"): [("        dist.all_reduce(p.grad)  # the sum",
                     "        if dist.get_rank() == 0:\n            dist.all_reduce(p.grad)  # the sum")],
    ("2", "crash"): [("        p.grad /= world_size\n", "        p.grad /= world_sise\n")],
    ("4", "per-parameter"): [("self.buckets = make_buckets(model.parameters(), cap)",
                              "self.buckets = [[p] for p in reversed(list(model.parameters()))]")],
    # waiting on the last handle only: right or wrong by luck on the numbers, always caught by the recorder
    ("4", "not-waited"): [(WAIT_EVERY, ("        self.pending[-1][0].wait()  # the last one done: so are the others?\n"
                                       "        for handle, flat, i in self.pending:\n"))],
    ("4", "not-reset"): [("        self.pending, self.ready = [], [0] * len(self.buckets)\n", "")],
    # every all_reduce started after backward(): right numbers, no overlap
    ("4", "no-overlap"): [(("            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])\n"
                           "            self.pending.append((dist.all_reduce(flat, async_op=True), flat, i))\n"),
                           "            self.pending.append((None, None, i))\n"),
                          (WAIT_EVERY, ("        for _, _, i in self.pending:\n"
                                       "            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])\n"
                                       "            dist.all_reduce(flat)\n"))],
    ("5", "state-not-sharded"): [("torch.optim.Adam(mine, lr=args.lr)", "torch.optim.Adam(model.parameters(), lr=args.lr)")],
    ("6c", "factor"): [("(loss / args.accum).backward()", "(loss / args.accum ** 2).backward()")],
}

CORRECT_ALTERNATIVES = {
    ("2", "ReduceOp.AVG"): [(("        dist.all_reduce(p.grad)  # the sum over ranks (ReduceOp.SUM), in place, on every rank\n"
                             "        p.grad /= world_size\n"),
                             "        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n")],
    ("4", "divided before the all-reduce"): [
        ("flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])",
         "flat = torch.cat([q.grad.flatten() for q in self.buckets[i]]) / self.world_size"),
        ("            flat /= self.world_size\n", "")],
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """check() of every launched mistake and correct alternative, two at a time; no process left behind."""
    root = tmp_path_factory.mktemp("launched")

    def one(item):
        (key, name), edits = item
        folder = root / (f"{key}-" + re.sub(r"\W+", "-", name))
        path = folder / EXERCISES[key].script
        folder.mkdir()
        path.write_text(mutate(key, *edits))
        start = time.monotonic()
        result = check(key, path, work_dir=folder / "work", results_file=folder / "results.json", show=False)
        result.wall = time.monotonic() - start
        return (key, name), result

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(pool.map(one, {**LAUNCHED_MISTAKES, **CORRECT_ALTERNATIVES}.items()))
    assert wait_for_no_processes(str(root), timeout=10) == [], "processes of a check left behind"
    return results


@pytest.mark.parametrize(("key", "diagnosis"), LAUNCHED_MISTAKES, ids=lambda v: v)
def test_launched_mistake_gets_its_hint(key, diagnosis, checked):
    result = checked[key, diagnosis]
    assert result.diagnosis == diagnosis, result.symptom
    assert result.hint == EXERCISES[key].hints_for(diagnosis)[0]
    assert diagnosis in EXERCISES[key].hints or diagnosis in ("hang", "crash", "factor"), "a hint of its own"
    if diagnosis in ("summed", "loss-summed"):
        assert "2.00×" in result.symptom or "exactly 2×" in result.symptom
    if diagnosis == "factor":
        assert "exactly 0.25×" in result.symptom
    if diagnosis == "hang":
        assert result.status == "error" and "line" in result.symptom
    if diagnosis == "crash":
        assert "NameError" in result.symptom and "ex2_by_hand.py line" in result.symptom
    print(f"{key}/{diagnosis}: {result.wall:.1f} s")


@pytest.mark.parametrize(("key", "name"), CORRECT_ALTERNATIVES, ids=lambda v: v)
def test_correct_alternative_passes(key, name, checked):
    result = checked[key, name]
    assert result.passed, result.symptom


DEBUG_LAB = {"6a": ("hang", "dist.all_reduce(sums)"), "6b": ("same-order", "epoch 1"),
             "6c": ("accum-not-divided", "4.00×")}


@pytest.mark.parametrize("key", DEBUG_LAB)
def test_debugging_lab_script_as_committed_shows_its_symptom(key):
    """Read from notebook 09's headless run (conftest.executed_notebook), which checks the committed scripts:
    its results.json holds each one's diagnosis and symptom."""
    run = executed_notebook(NOTEBOOK).require_ok()
    result = json.loads(run.written(RUNS / NOTEBOOK / "results.json").read_text())["exercises"][key]
    diagnosis, shown = DEBUG_LAB[key]
    assert result["diagnosis"] == diagnosis and shown in result["symptom"], result["symptom"]
    assert result["script"] == f"scripts/{EXERCISES[key].script}" and result["hint_level"] >= 1


def test_single_device_script_is_the_reference(tmp_path):
    """Exercise 1's reference (computed in-process by the checker) is what ex1_single.py computes."""
    seed = ex1_convert.CONFIG["seed"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPTS / "ex1_single.py"), "--out", str(tmp_path), "--seed", str(seed)],
                   check=True, capture_output=True, env=env, timeout=120)
    ref = ex1_convert.reference()
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log if "loss" in r] == pytest.approx(ref.losses, abs=1e-5)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    for (name, value), expected in zip(state.items(), ref.params[-1], strict=True):
        torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-4, msg=name)
    assert (log[-1]["val_correct"], log[-1]["val_total"]) == ref.val


def test_two_simulated_ranks_equal_the_single_process_reference():
    """What every check relies on: 2 ranks x B/2 with averaged gradients = 1 process x B, to float rounding."""
    one, two = ex2_by_hand.reference(), ex2_by_hand.reference(2)
    for a, b in zip(one.params[-1], two.params[-1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
