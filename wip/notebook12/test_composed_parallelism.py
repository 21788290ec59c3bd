"""Notebook 12: FSDP2 x TP on a 2 x 2 mesh and HSDP (replicate x shard) each train the same model as one process
(train_lm.py), the mixture-of-experts layer with all_to_all_single equals the one-process layer and its counted
bytes equal the prediction, a DCP checkpoint saved on 2 x 2 continues the same on one process, and the mesh's
groups are what the notebook draws. Four processes on 2 cores: launched with allow_oversubscribe=True."""

import pytest
import torch

from course.launcher import launch
from course.scriptdiff import script_diff

QUIET = {"on_line": lambda _: None, "quiet": True, "allow_oversubscribe": True, "timeout": 300}
LOSS_TOL = 1e-5  # notebook 10's fp32 tolerance for the losses of every step
PARAM_TOL = 3e-4  # notebook 10's tolerance for every final parameter after the same AdamW steps
STEPS = 12


def run(script, nproc, args, run_dir):
    return launch(script, nproc=nproc, args=[str(a) for a in args], run_dir=run_dir, **QUIET)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    metrics = run("train_lm.py", 1, ["--steps", STEPS, "--log-every", STEPS, "--save", root / "lm.pt"], root / "run").metrics
    return metrics, torch.load(root / "lm.pt")


def assert_same_training(single, layout, extra, tmp_path):
    metrics, lm_state = single
    args = ["--steps", STEPS, "--log-every", STEPS, "--layout", layout, *extra, "--save", tmp_path / "w.pt"]
    got = run("train_2d.py", 4, args, tmp_path / "run").metrics
    assert got["world_size"] == 4 and got["layout"] == layout and len(got["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(metrics["losses"], got["losses"])) < LOSS_TOL
    state = torch.load(tmp_path / "w.pt")
    assert set(state) == set(lm_state)
    worst = max((lm_state[k] - state[k]).abs().max().item() for k in lm_state)
    assert worst < PARAM_TOL, worst
    return got


def test_fsdp2_x_tp_trains_the_same_model_as_one_process(single, tmp_path):
    got = assert_same_training(single, "2d", ["--sequence-parallel"], tmp_path)
    assert got["mesh"] == {"dp": 2, "tp": 2}
    assert got["params_per_rank"] < 0.3 * single[0]["params"]  # a quarter of each sharded tensor, and more


def test_hsdp_trains_the_same_model_as_one_process(single, tmp_path):
    got = assert_same_training(single, "hsdp", [], tmp_path)
    assert got["mesh"] == {"replicate": 2, "shard": 2}
    assert got["params_per_rank"] < 0.55 * single[0]["params"]  # sharded in 2, replicated across the other 2


def test_train_2d_is_train_tp_plus_marked_steps():
    diff = script_diff("train_tp.py", "train_2d.py", marker=r"2D step (\d)")
    assert diff.steps == {1, 2, 3, 4}
    assert not diff.unmarked, diff.unmarked


def test_experts_equal_one_process_and_bytes_equal_the_prediction(tmp_path):
    m = run("moe_layer.py", 4, [], tmp_path).metrics
    assert m["world_size"] == 4 and m["max_difference_all_ranks"] < 1e-5
    assert set(m["differences_rank0"]) == {"output", "input_grad", "router_grad", "expert_grads"}
    splits = m["splits"]
    assert all(sum(row) == m["tokens_per_rank"] for row in splits)  # every token sent once
    assert len({v for row in splits for v in row}) > 1  # the splits are uneven
    assert m["counted"] == m["predicted"]
    assert m["counted"]["backward"]["all-to-all"][0] == 2  # the gradients go back through both exchanges


def test_checkpoint_saved_on_2x2_continues_the_same_on_one_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = run("dcp_reshape.py", 4, ["--save", ckpt], tmp_path / "save").metrics
    loaded = run("dcp_reshape.py", 1, ["--load", ckpt, "--dp", "1"], tmp_path / "load").metrics
    assert saved["mesh"] == {"dp": 2, "tp": 2} and loaded["mesh"] == {"dp": 1, "tp": 1}
    assert sum(f.endswith(".distcp") for f in saved["checkpoint_files"]) == 4  # each rank wrote its own part
    assert len(saved["losses_after"]) == len(loaded["losses_after"]) == 4
    assert max(abs(a - b) for a, b in zip(saved["losses_after"], loaded["losses_after"])) < LOSS_TOL
    assert saved["losses_after"][0] < saved["losses_before"][0]  # it continued, not restarted


def test_mesh_groups_are_rows_and_columns(tmp_path):
    m = run("mesh_basics.py", 4, [], tmp_path).metrics
    assert m["mesh"] == [[0, 1], [2, 3]] and m["names"] == ["dp", "tp"]
    by_rank = {r["rank"]: r for r in m["ranks"]}
    assert by_rank[1]["tp"] == [0, 1] and by_rank[1]["dp"] == [1, 3]
    assert by_rank[1]["sum_of_ranks_on_tp"] == 1 and by_rank[1]["sum_of_ranks_on_dp"] == 4
