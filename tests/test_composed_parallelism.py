"""Notebook 12. Read from its own headless run (conftest.executed_notebook, shared with tests/test_notebooks.py):
FSDP2 x TP and HSDP = one process, HSDP's bytes per mesh dimension counted = predicted, the DCP checkpoint moved
2 x 2 -> 1 process, the expert layer = one process with its bytes counted = predicted. With no launch or runs of
their own: exercise 9's checker on its solution and on its classic mistakes (mutants the notebook never runs), the
stub unsolved without running, the marked diff train_tp.py -> train_2d.py, the layout chooser (course.choose),
the counter's per-group records (course.comm_count) and the mixture-of-experts layer."""

import pytest
import torch
from conftest import executed_notebook
from exercise_helpers import mutate, run_check_fixture  # noqa: F401 - the run_check fixture

from course import SCRIPTS
from course.choose import layouts, pick, table
from course.comm_count import _KINDS
from course.exercises import EXERCISES
from course.moe import moe_layer, moe_tokens
from course.scriptdiff import script_diff
from course.sharding import model_states, predict


def test_train_2d_is_train_tp_plus_marked_steps():
    diff = script_diff("train_tp.py", "train_2d.py", marker=r"2D step (\d)")
    assert diff.steps == {1, 2, 3, 4} and not diff.unmarked, diff.unmarked


def test_chooser_uses_notebook_08s_formulas_and_prefers_less_network_traffic():
    psi = 7e9
    rows = {r.name: r for r in layouts(psi, gpu_gb=80, gpus_per_node=8, nodes=4)}
    assert list(rows) == ["DDP", "HSDP", "FSDP2", "FSDP2 x TP", "FSDP2 x PP"]
    assert rows["DDP"].gb_per_gpu * 1e9 == model_states(predict(psi, 32)["DDP"]) == 16 * psi
    assert rows["HSDP"].gb_per_gpu == pytest.approx(16 * psi / 8 / 1e9)
    assert rows["FSDP2"].gb_per_gpu == pytest.approx(16 * psi / 32 / 1e9)
    assert not rows["DDP"].fits and rows["HSDP"].fits
    # HSDP: only 1/8 of the gradients cross nodes, in an all-reduce over the 4 nodes
    assert rows["HSDP"].inter_bytes == pytest.approx(2 * 3 / 4 * 4 * psi / 8)
    assert rows["FSDP2"].inter_bytes == pytest.approx(3 * 31 / 32 * 4 * psi)
    assert pick(list(rows.values())).name == "HSDP"
    one_node = layouts(1e9, 80, 8, 1)
    assert pick(one_node).name == "DDP" and all(r.inter_bytes == 0 for r in one_node)
    big = layouts(70e9, 80, 8, 16)
    assert pick(big).name == "FSDP2 x TP"  # HSDP does not fit; TP keeps FSDP's traffic 8x smaller across nodes
    assert pick(layouts(2e12, 80, 8, 2)) is None


def test_chooser_counts_tensor_parallel_activations_and_the_pipeline_by_hand():
    """Issue 32 #3: TP's own traffic (notebook 10's formulas) and a PP row (notebook 11), against numbers
    worked out here by hand for 7e9 parameters, 4 nodes x 8 GPUs, 8192 tokens per GPU, width 4096, 32 blocks."""
    rows = {r.name: r for r in layouts(7e9, 80, 8, 4, tokens=8192, width=4096, layers=32)}
    tp, pp = rows["FSDP2 x TP"], rows["FSDP2 x PP"]
    a = 8 * 8192 * 4096 * 4  # one activation of a TP group: 8 GPUs x 8192 tokens, width 4096, fp32
    # per block 2 all-reduces forward + 4 backward (q, k, v separate), each sending 2 x 7/8 of it, 32 blocks
    assert tp.intra_bytes == pytest.approx(32 * 6 * 2 * 7 / 8 * a) == pytest.approx(360.78e9, rel=1e-4)
    assert tp.inter_bytes == pytest.approx(3 * 3 / 4 * 4 * 7e9 / 8)  # FSDP2 over the 4 nodes on 1/8 of it
    assert tp.gb_per_gpu == pytest.approx(16 * 7e9 / 32 / 1e9) and tp.bubble == 0
    # PP: 4 stages (one per node), FSDP2 over the node's 8 GPUs on 1/4 of the parameters; a replica of 4 GPUs
    # computes 4 x 8192 tokens; a middle stage sends their activations forward and their gradients back
    assert pp.mesh == "4 x 8 (pp, dp)" and pp.gb_per_gpu == tp.gb_per_gpu
    assert pp.inter_bytes == 2 * (4 * 8192) * 4096 * 4 == 1_073_741_824
    assert pp.intra_bytes == pytest.approx(2 * 7 / 8 * 4 * 7e9 / 4)  # 1 all-gather + 1 reduce-scatter in a stage
    assert pp.bubble == pytest.approx(3 / 19)  # (p - 1)/(m + p - 1), m = 4 per stage
    # the bubble is shown, not picked: HSDP fits without one
    assert pick(list(rows.values())).name == "HSDP"
    assert "bubble 16%" in pp.note and "idle 16%" in table(list(rows.values()))
    one_node = {r.name: r for r in layouts(1e9, 80, 8, 1, tokens=8192, width=2048, layers=20)}
    assert one_node["FSDP2 x TP"].intra_bytes == pytest.approx(20 * 6 * 2 * 7 / 8 * 8 * 8192 * 2048 * 4)
    assert one_node["FSDP2 x PP"].mesh == "8 x 1 (pp, dp)" and one_node["FSDP2 x PP"].inter_bytes == 0
    assert "cross nodes" not in one_node["FSDP2"].note and "cross nodes" in rows["FSDP2"].note


def test_counter_takes_c10d_ops_whole_tensor_from_the_right_argument():
    # c10d ops take (output, input): the all-gather's whole tensor is its output, the reduce-scatter's its input
    assert _KINDS["_allgather_base_"] == ("all-gather", 1)
    assert _KINDS["_reduce_scatter_base_"] == ("reduce-scatter", "second")
    assert _KINDS["all_gather_into_tensor"] == ("all-gather", "group")  # functional: the input x group size


def test_moe_layer_is_the_same_on_every_rank_and_routes_unevenly():
    a, b = moe_layer(4, seed=0), moe_layer(4, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    x = torch.cat([moe_tokens(r, 32) for r in range(4)])
    _, expert = a.route(x)
    counts = torch.bincount(expert, minlength=4)
    assert counts.sum() == 128 and len(set(counts.tolist())) > 1
    assert not torch.equal(moe_tokens(0, 8), moe_tokens(1, 8))


def test_exercise_9_solution_passes_and_its_mistakes_are_named(run_check):
    assert run_check("9", path=EXERCISES["9"].solution).status == "pass"
    swapped = mutate("9", ("all_to_all_single(x[order], recv_splits, send_splits",
                           "all_to_all_single(x[order], send_splits, recv_splits"))
    result = run_check("9", swapped)
    assert result.diagnosis == "splits" and "line" in result.symptom, result.symptom
    unsorted = mutate("9", ("out = torch.empty_like(back).index_copy(0, order, back)", "out = back"))
    assert run_check("9", unsorted).diagnosis == "combine-order"


def test_exercise_9_stub_is_unsolved_without_running():
    from course.exercises.running import static_check

    verdict = static_check(SCRIPTS / EXERCISES["9"].script)
    assert verdict is not None and verdict.diagnosis == "gaps" and verdict.symptom.count("\n") == 4


# ----------------------------------------------- read from notebook 12's own headless run (no launch of their own)


@pytest.fixture(scope="module")
def notebook():
    return executed_notebook("12_composed_parallelism").require_ok()


@pytest.mark.parametrize("name", ["2d", "hsdp"])
def test_composed_layouts_train_the_same_model_as_one_process(notebook, name):
    single, composed = notebook.metrics("lm"), notebook.metrics(name)
    lm_state = torch.load(notebook.weights("lm.pt"))
    state = torch.load(notebook.weights(f"{name}.pt"))
    assert composed["world_size"] == 4 and len(composed["losses"]) == len(single["losses"]) >= 8
    assert max(abs(a - b) for a, b in zip(single["losses"], composed["losses"])) < 1e-5
    assert set(state) == set(lm_state)
    assert max((lm_state[k] - state[k]).abs().max().item() for k in lm_state) < 3e-4
    assert composed["params_per_rank"] < composed["params"]


def test_hsdp_bytes_per_mesh_dimension_counted_equal_the_prediction(notebook):
    hb = notebook.metrics("hsdp_bytes")
    assert set(hb["counted"]) == {"shard", "replicate"} and hb["counted"] == hb["predicted"]
    assert hb["other_groups"] == 0
    assert hb["counted"]["replicate"]["backward"]["all-reduce"][1] == 2 * hb["params"]  # half the fp32 gradients


def test_dcp_checkpoint_continues_the_same_on_another_mesh_shape(notebook):
    saved, one = notebook.metrics("dcp_save"), notebook.metrics("dcp_1")
    assert saved["world_size"] == 4 and one["world_size"] == 1
    assert max(abs(a - b) for a, b in zip(saved["losses_after"], one["losses_after"])) < 1e-5
    assert saved["losses_after"][0] < saved["losses_before"][0]


def test_expert_layer_equals_one_process_and_its_bytes_the_prediction(notebook):
    moe = notebook.metrics("moe")
    assert moe["max_difference_all_ranks"] < 1e-5 and moe["counted"] == moe["predicted"]
    assert all(sum(row) == moe["tokens_per_rank"] for row in moe["splits"])
    assert len({n for row in moe["splits"] for n in row}) > 1  # uneven splits
