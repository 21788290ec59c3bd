"""Notebook 11: the GPT cut into stages, a 2-stage pipeline by hand (= one process), train_pp.py on 2 gloo ranks
= train_lm.py on one (losses of every step, final parameters), every torch.distributed.pipelining schedule's
gradients = one process, the bubble formula against the recorded timelines (structure, not speed), the
activations each schedule holds, the marked diff between train_lm.py and train_pp.py, the two pitfalls
bounded, and exercise 8's checker on its solution and its mistakes. What notebook 11's own headless run already
launched is read from that run (conftest.executed_notebook, shared with tests/test_notebooks.py); the tests that
launch do so for what the quick notebook does not run (the pitfalls' fixes, exercise 8's mutated solutions)."""

import pytest
import torch
from conftest import executed_notebook
from exercise_helpers import mutate, run_check_fixture  # noqa: F401 - the run_check fixture

from course import ROOT, SCRIPTS
from course.bubble import predicted_bubble, predicted_in_flight, replay, summarise
from course.exercises import EXERCISES
from course.gpt import GPT, GPTConfig
from course.gpt_stages import GPTStage, layer_ranges
from course.launcher import launch
from course.scriptdiff import script_diff

QUIET = {"on_line": lambda _: None, "quiet": True}
GRAD_TOL = 1e-6  # fp32 gradients: micro-batches only change the order of the sums
LOSS_TOL = 1e-4  # what notebook 11 states for fp32 over its 60 steps: losses of every step
PARAM_TOL = 1e-4  # every final parameter (absolute): AdamW turns rounding in a tiny gradient into up to lr


def test_stages_hold_the_whole_model_once_under_its_own_names():
    assert [list(r) for r in layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="--n-layer"):
        layer_ranges(2, 4)
    model = GPT(GPTConfig(n_layer=4))
    parts = [GPTStage(model, i, 4).state_dict() for i in range(4)]
    names = [k for part in parts for k in part]
    assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))
    x = torch.randint(0, 14, (3, 8))
    h = x
    for i in range(4):
        h = GPTStage(model, i, 4)(h)
    assert torch.equal(h, model(x))


def test_replay_of_a_gpipe_order_gives_the_formula():
    # 2 ranks, 3 micro-batches, GPipe order; the recorded times are deliberately noisy (replay ignores them)
    ev = {0: [("F", 0, 1, 0, 0), ("F", 1, 2, 0, 1), ("F", 2, 3, 0, 2), ("B", 9, 10, 0, 2), ("B", 10, 11, 0, 1),
              ("B", 11, 12, 0, 0)],
          1: [("F", 1, 2, 1, 0), ("F", 2, 3, 1, 1), ("F", 3, 4, 1, 2), ("B", 4, 5, 1, 2), ("B", 5, 6, 1, 1),
              ("B", 6, 7, 1, 0)]}
    idle, _ = replay(ev, (0, 20), num_stages=2)
    assert idle == {0: pytest.approx(predicted_bubble(2, 3)), 1: pytest.approx(predicted_bubble(2, 3))}
    with pytest.raises(ValueError, match="cannot be replayed"):
        replay({0: [("B", 0, 1, 0, 0)], 1: []}, (0, 2), num_stages=2)


def test_the_bubble_figure_is_drawn_from_the_schedules_and_shows_the_memory_difference():
    """Learner review §4 #8: the committed figure is what course.pp_report draws from the schedules' own order,
    and it shows GPipe's rank 0 holding all m micro-batches where 1F1B's holds p."""
    from course.pp_report import bubble_svg, in_flight, schedule_order

    for p, m in [(2, 2), (2, 8), (4, 8), (8, 16)]:
        for rank in range(p):
            for schedule in ("gpipe", "1f1b"):
                order = schedule_order(schedule, p, m, rank)
                assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                assert in_flight(order) == predicted_in_flight(schedule, p, m, rank)
    svg = (ROOT / "notebooks" / "figures" / "11_bubble.svg").read_text()
    assert svg == bubble_svg(), "run python -m course.pp_report to redraw notebooks/figures/11_bubble.svg"
    assert "GPipe's rank 0 holds the activations of all 8 micro-batches" in svg and "holds at most 4" in svg
    assert svg.count("holds 8 micro-batches") == 4 and "holds 4 micro-batches" in svg


@pytest.fixture(scope="module")
def notebook():
    return executed_notebook("11_pipeline_parallel").require_ok()


def test_pipeline_by_hand_equals_one_process(notebook):
    metrics = notebook.metrics("by_hand")
    assert metrics["world_size"] == 2 and metrics["microbatches"] == 4
    for r in metrics["ranks"]:
        assert r["one_batch_grad_diff"] < GRAD_TOL and r["gpipe_grad_diff"] < GRAD_TOL, r
        assert r["weight_diff"] < PARAM_TOL, r
    last = metrics["ranks"][-1]
    assert max(abs(a - b) for a, b in zip(last["losses"], last["ref_losses"])) < LOSS_TOL
    assert "tok_emb.weight" in metrics["ranks"][0]["params"] and "head.weight" in last["params"]


def test_pipeline_trains_the_same_model_as_one_process(notebook):
    single, pp = notebook.metrics("lm"), notebook.metrics("pp")
    lm_state, pp_state = torch.load(notebook.weights("lm.pt")), torch.load(notebook.weights("pp.pt"))
    assert pp["world_size"] == 2 and pp["schedule"] == "1f1b" and pp["microbatches"] == 4
    assert len(pp["losses"]) == len(single["losses"]) >= 3
    assert max(abs(a - b) for a, b in zip(single["losses"], pp["losses"])) < LOSS_TOL
    assert single["losses"][-1] < single["losses"][0]  # it learns
    assert set(lm_state) == set(pp_state)
    assert max((lm_state[k] - pp_state[k]).abs().max().item() for k in lm_state) < PARAM_TOL
    assert abs(single["val_loss"] - pp["val_loss"]) < LOSS_TOL


def test_every_schedule_matches_one_process_and_the_formula(notebook):
    rows = {r["config"]: r for r in summarise(notebook.metrics("schedules"))}
    most = max(r["m"] for r in rows.values())  # the interleaved schedules run at the largest m only
    assert {"gpipe m=2", "gpipe m=4", "1f1b m=2", "1f1b m=4", f"interleaved1f1b m={most}",
            f"zerobubble m={most}"} <= set(rows)
    for row in rows.values():
        assert row["grad_diff"] < GRAD_TOL, row
        assert len(row["step_ms"]) >= 5
        if row["schedule"] != "zerobubble":  # the recorded order, replayed, has the predicted bubble
            assert row["replayed"] == pytest.approx(row["predicted"], abs=0.01), row
        assert row["measured"] >= row["replayed"] - 0.02  # real time only adds idle (waits, Python)
    assert rows[f"zerobubble m={most}"]["replayed"] < rows[f"interleaved1f1b m={most}"]["replayed"]
    for m in (2, 4):
        gpipe, one = rows[f"gpipe m={m}"], rows[f"1f1b m={m}"]
        assert gpipe["in_flight"] == {0: m, 1: m}
        assert one["in_flight"] == {0: min(m, 2), 1: 1}
        for rank in (0, 1):  # activations held: 1F1B keeps in_flight of GPipe's m micro-batches
            ratio = one["activation_bytes"][rank] / gpipe["activation_bytes"][rank]
            assert ratio == pytest.approx(one["in_flight"][rank] / m, rel=0.05)


def test_train_pp_differs_from_train_lm_only_by_marked_steps():
    d = script_diff("train_lm.py", "train_pp.py", marker=r"PP step (\d)")
    assert d.steps == {1, 2, 3, 4, 5} and d.unmarked == []


def test_exercise_8_solution_passes_and_its_mistakes_are_named(run_check):
    assert run_check("8", path=EXERCISES["8"].solution).status == "pass"
    unscaled = mutate("8", ("loss = loss_fn(stage(h), ym) / m", "loss = loss_fn(stage(h), ym)"))
    assert run_check("8", unscaled).diagnosis == "not-scaled"
    reversed_order = mutate("8", ("outputs[i].backward(grad)", "outputs[m - 1 - i].backward(grad)"))
    assert run_check("8", reversed_order).diagnosis == "stage0-backward"
    not_sent = mutate("8", ("dist.send(inputs[i].grad, dst=0)", "pass"))
    result = run_check("8", not_sent)
    assert result.diagnosis == "hang" and "rank 0" in result.symptom, result.symptom


def test_exercise_8_stub_is_unsolved_without_running():
    from course.exercises.running import static_check

    verdict = static_check(SCRIPTS / EXERCISES["8"].script)
    assert verdict is not None and verdict.diagnosis == "gaps" and verdict.symptom.count("\n") == 3


def test_a_send_without_its_receive_is_ended_by_the_timeout_naming_each_rank(notebook):
    output = notebook.output()  # the notebook ran the hang and printed where each rank waited
    stopped = {line.split("rank ", 1)[1][:1]: line for line in output.splitlines()
               if "stopped after" in line and "rank " in line}
    assert set(stopped) == {"0", "1"}, output[-2000:]
    assert "send activations of micro-batch 1" in stopped["0"] and "send gradient of micro-batch 0" in stopped["1"]
    assert any("Timed out" in line for line in stopped.values())  # the other may see the connection closed


def test_unequal_micro_batches_leave_stale_rows_and_the_header_fixes_it(notebook):
    """The bug as the notebook's run showed it; the fix launched here (the quick notebook skips it)."""
    assert "rank 0 sent 6 samples, buffer of 8, 2 never written" in notebook.output()
    good = launch("pitfall_pp_shapes.py", nproc=2, args=["--fix"], timeout=120, **QUIET)
    assert "rank 0 sent 6 samples, buffer of 6, 0 never written" in good.output and "never written" in good.output
