"""Notebook 10: the small GPT and its data, tensor parallelism by hand (= the unsplit layers), train_tp.py on
2 gloo ranks = train_lm.py on one (losses of every step, final parameters), the collectives of a step
counted = the formulas' prediction, and the marked diff between the two scripts. The launched facts are read
from notebook 10's own headless run (conftest.executed_notebook: one run per session, shared with
tests/test_notebooks.py), not from launching its scripts again; exercise 7's checker gets runs of its own, on
mutated solutions the notebook never runs."""

import json

import pytest
import torch
from conftest import executed_notebook
from exercise_helpers import mutate, run_check_fixture  # noqa: F401 - the run_check fixture

from course.comm_count import predict_tp_step, same_counts
from course.exercises import EXERCISES
from course.gpt import GPT, GPTConfig, loss_fn
from course.lm_data import IGNORE, load_lm_data
from course.scriptdiff import script_diff

LOSS_TOL = 1e-5  # what notebook 10 states for fp32: losses of every step
PARAM_TOL = 3e-4  # every final parameter (absolute) after the same AdamW steps at lr 3e-3 (a tenth of one step's
# largest move): AdamW divides a gradient by its own running size, so a unit whose gradient is ~0 moves on noise


@pytest.fixture(scope="module")
def notebook():
    return executed_notebook("10_tensor_parallel").require_ok()


def test_arithmetic_data_is_deterministic_and_counts_only_the_answer():
    a, b = load_lm_data(), load_lm_data()
    assert torch.equal(a.train, b.train) and len(a.train) == 9000 and len(a.val) == 1000
    assert a.vocab_size % 4 == 0  # a vocabulary-split head on 2 or 4 ranks
    x, y = a.batch("train", 3, 16, seed=1)
    x2, y2 = a.batch("train", 3, 16, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, a.batch("train", 4, 16, seed=1)[0])
    text = a.decode(torch.cat([x[0], y[0, -1:]]))
    left, right = text.split("=")
    assert int(left.split("+")[0]) + int(left.split("+")[1]) == int(right)
    assert (y[:, :5] == IGNORE).all() and (y[:, 5:] != IGNORE).all()  # the 3 answer digits count
    perfect = torch.nn.functional.one_hot(y.clamp(min=0), a.vocab_size).float()
    assert a.accuracy(perfect, y) == (16, 16)
    perfect[0, 6] = perfect[0, 6].flip(0)  # one wrong digit: that sample is wrong
    assert a.accuracy(perfect, y) == (15, 16)


def test_text_folder_is_one_argument_away(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    data = load_lm_data(tmp_path, block_size=16)
    assert data.block_size == 16 and data.vocab_size % 8 == 0 and data.counted.all()
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=16))
    x, y = data.batch("train", 0, 4)
    assert loss_fn(model(x), y).item() > 0


def test_gpt_widths_divide_over_2_and_4_ranks():
    cfg = GPTConfig()
    assert cfg.n_head % 4 == 0 and cfg.n_embd % 4 == 0 and (4 * cfg.n_embd) % 4 == 0
    with pytest.raises(ValueError):
        GPTConfig(n_embd=30, n_head=4)


def test_layers_split_by_hand_equal_the_unsplit_ones(notebook):
    metrics = notebook.metrics("by_hand")
    assert metrics["world_size"] == 2 and metrics["max_difference_all_ranks"] < 1e-5
    assert set(metrics["differences_rank0"]) >= {"output", "input_grad", "fc.weight_grad", "proj.weight_grad"}
    assert metrics["params_per_rank"] < 33088  # each rank holds about half of the MLP


@pytest.mark.parametrize("name", ["proof_tp", "proof_tp_sp"])
def test_tensor_parallel_trains_the_same_model_as_one_process(notebook, name):
    single, tp = notebook.metrics("proof_lm"), notebook.metrics(name)
    lm_state = torch.load(notebook.weights("proof_lm.pt"))
    tp_state = torch.load(notebook.weights(f"{name}.pt"))
    assert tp["world_size"] == 2 and tp["sequence_parallel"] == name.endswith("_sp")
    assert len(tp["losses"]) == len(single["losses"]) >= 10
    assert max(abs(a - b) for a, b in zip(single["losses"], tp["losses"])) < LOSS_TOL
    assert single["losses"][-1] < single["losses"][0]  # it learns
    assert set(lm_state) == set(tp_state)
    worst = max((lm_state[k] - tp_state[k]).abs().max().item() for k in lm_state)
    assert worst < PARAM_TOL, worst
    assert tp["params_per_rank"] < 0.6 * single["params"]


def test_train_tp_is_train_lm_plus_marked_steps():
    diff = script_diff("train_lm.py", "train_tp.py", marker=r"TP step (\d)")
    assert diff.steps == {1, 2, 3, 4, 5}
    assert not diff.unmarked, diff.unmarked


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_collectives_counted_equal_the_prediction(notebook, sequence_parallel):
    metrics = notebook.metrics("costs_sp" if sequence_parallel else "costs")
    cfg, tokens = metrics["config"], metrics["tokens"]
    assert same_counts(predict_tp_step(cfg["n_layer"], tokens, cfg["n_embd"], sequence_parallel), metrics["step"])
    assert same_counts(metrics["predicted_block"], metrics["block"]), json.dumps(metrics["block"])
    per_rank, one = metrics["bytes_per_rank"], metrics["one_process"]
    assert per_rank["gradients"] == per_rank["parameters"] and per_rank["optimizer_state"] == 2 * per_rank["parameters"]
    assert per_rank["parameters"] < 0.55 * one["parameters"]
    assert 0 < per_rank["activations"] < one["activations"]


EX7_MISTAKES = {
    "no-forward-reduce": [("        dist.all_reduce(out)  # partial sums over the rows", "        # partial sums over the rows")],
    "no-backward-reduce": [("        dist.all_reduce(grad)  # each rank has its columns'", "        # each rank has its columns'")],
    "backward-summed-twice": [("        return grad  # already whole on every rank",
                               "        dist.all_reduce(grad)\n        return grad  # already whole on every rank")],
}


def test_exercise_7_solution_passes(run_check):
    assert run_check("7", path=EXERCISES["7"].solution).status == "pass"


@pytest.mark.parametrize("diagnosis", list(EX7_MISTAKES))
def test_exercise_7_mistake_gets_its_hint(diagnosis, run_check):
    result = run_check("7", mutate("7", *EX7_MISTAKES[diagnosis]))
    assert result.status == "fail" and result.diagnosis == diagnosis, (result.status, result.diagnosis)
    assert result.hint == EXERCISES["7"].hints_for(diagnosis)[0]
