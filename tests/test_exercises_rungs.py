"""Issue 44 item 3: the first hint rung names the kind of mistake from what the run saw (an error's type and
text, which ranks agree, what the recorder saw each rank call or read, the shape of a shard). In this process,
on recorded results of each kind (fabricated records, outputs and saved tensors): no torchrun job."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from course import bench_checker
from course.exercises import (
    EXERCISES,
    crashes,
    ex1_convert,
    ex2_by_hand,
    ex5_zero1,
    ex6_debug,
    ex7_tp,
    ex9_experts,
)
from course.exercises.hints import COMMON_HINTS, GENERIC
from course.exercises.reference import NPROC
from course.exercises.results import Stop, Verdict
from course.exercises.running import Run, failure

ERRORS = {  # error lines as the ranks print them (torch 2.14, gloo), and the kind each is
    "NameError: name 'world_sise' is not defined": "crash-name",
    "AttributeError: 'DistributedSampler' object has no attribute 'set_epochs'. Did you mean: 'set_epoch'?": "crash-name",
    "TypeError: Object of type Tensor is not JSON serializable": "crash-json",
    ("TypeError: Invalid function argument. Expected parameter `tensor` of type torch.Tensor but got <class "
     "'NoneType'> instead."): "crash-none",
    ("TypeError: Invalid function argument. Expected parameter `tensor` of type torch.Tensor but got <class "
     "'float'> instead."): "crash-not-tensor",
    "RuntimeError: grad can be implicitly created only for scalar outputs": "crash-grad",
    "RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn": "crash-no-graph",
    ("RuntimeError: Trying to backward through the graph a second time (or directly access saved tensors after they "
     "have already been freed)."): "crash-graph-freed",
    "RuntimeError: a leaf Variable that requires grad is being used in an in-place operation.": "crash-leaf-inplace",
    ("ValueError: DistributedDataParallel device_ids and output_device arguments only work with single-device/"
     "multiple-device GPU modules or CPU modules, but got device_ids [0]"): "crash-device",
    ("RuntimeError: The size of tensor a (24) must match the size of tensor b (16) at non-singleton dimension "
     "1"): "crash-shape",
    "ZeroDivisionError: division by zero": None,
}


def fails(fn, *args, **kwargs) -> Verdict:
    with pytest.raises(Stop) as stopped:
        fn(*args, **kwargs)
    return stopped.value.verdict


@pytest.mark.parametrize("error", list(ERRORS))
def test_a_crash_is_named_by_its_error_and_its_first_rung_says_the_kind(error):
    verdict = crashes.named(Verdict("error", "crash", "rank 1 crashed", {"errors": {1: error}, "rank": 1}))
    assert verdict.diagnosis == (ERRORS[error] or "crash")
    first = EXERCISES["1"].hints_for(verdict.diagnosis)[0]
    assert (first != COMMON_HINTS["crash"][0]) == (ERRORS[error] is not None)
    assert crashes.named(Verdict("error", "hang", "", {"errors": {0: error}})).diagnosis == "hang"  # a hang stays one


def test_each_refusal_of_backward_is_a_kind_whose_first_rung_names_its_own_cause():
    """Audit N6-10: one kind, crash-grad, matched four refusals of backward() while its ladder named two causes
    (a non-scalar output, no graph) and told the learner to call loss.backward(). Each refusal, raised here by this
    torch, is now its own kind; its first rung names its cause and no other's."""
    x = torch.ones(3, requires_grad=True)

    def no_graph():
        with torch.no_grad():
            y = (x * 2).sum()
        y.backward()

    def twice():
        y = (x * x).sum()
        y.backward()
        y.backward()

    refusals = {"crash-grad": (lambda: (x * 2).backward(), "not a scalar"), "crash-no-graph": (no_graph, "no graph"),
                "crash-graph-freed": (twice, "a second time"), "crash-leaf-inplace": (lambda: x.add_(1), "in-place")}
    for kind, (refused, cause) in refusals.items():
        with pytest.raises(RuntimeError) as raised:
            refused()
        error = f"RuntimeError: {raised.value}"
        verdict = crashes.named(Verdict("error", "crash", "rank 0 crashed", {"errors": {0: error}, "rank": 0}))
        assert verdict.diagnosis == kind, (kind, error)
        first = EXERCISES["1"].hints_for(kind)[0]
        assert cause in first and not [c for _, c in refusals.values() if c != cause and c in first], (kind, first)
        assert kind not in GENERIC and len(COMMON_HINTS[kind]) == 3


def test_the_error_is_read_whole_when_torch_breaks_its_line(tmp_path):
    """torch's "Invalid function argument" message goes on, indented, on a second line: the type it got is there."""
    path = (tmp_path / "ex8_pipeline.py").resolve()
    output = "".join(f"[rank1]:{line}\n" for line in (
        "Traceback (most recent call last):", f'  File "{path}", line 52, in main',
        "    dist.send(inputs[i].grad, dst=0)", ("TypeError: Invalid function argument. Expected parameter `tensor` "
        "of type torch.Tensor"), "             but got <class 'NoneType'> instead."))
    verdict = crashes.named(fails(failure, Run(1, output, {}, tmp_path, 1.0), path, 90))
    assert verdict.diagnosis == "crash-none" and "line 52" in verdict.symptom, verdict.symptom


# ------------------------------------------------------------------ exercise 1: what the samplers yielded
def _run_with_samplers(lists_of_rank) -> SimpleNamespace:
    return SimpleNamespace(records={r: {"samplers": [{"indices": lists} for lists in lists_of_rank(r)]}
                                    for r in range(NPROC)})


def test_ex1_a_loss_that_differs_is_read_from_what_the_samplers_yielded():
    from torch.utils.data import DistributedSampler

    train = ex1_convert.wave_datasets()[0]
    right = {r: list(DistributedSampler(train, num_replicas=NPROC, rank=r, seed=ex1_convert.CONFIG["seed"]))
             for r in range(NPROC)}
    assert fails(ex1_convert._check_data, _run_with_samplers(lambda r: []), "loss differs", 0).diagnosis == "hand-split"
    ordered = _run_with_samplers(lambda r: [list(range(len(train)))[r::NPROC]])
    assert fails(ex1_convert._check_data, ordered, "loss differs", 0).diagnosis == "no-shuffle"
    assert fails(ex1_convert._check_data, _run_with_samplers(lambda r: [right[r]]), "", 0).diagnosis == "first-loss"
    ex1_convert._check_data(_run_with_samplers(lambda r: [right[r]]), "", 5)  # from a later step: not this rule


# ------------------------------------------------------------------ exercise 2: what the recorder saw each rank call
def _call(op, t, where="ex2_by_hand.py:36", asynchronous=False, waited=None):
    return {"op": op, "t": t, "where": where, "async": asynchronous, "waited": waited, "touched": None}


def test_ex2_collectives_name_the_broadcast_and_the_async_mistakes():
    from course.exercises.ex4_overlap import check_waits

    hung = SimpleNamespace(records={r: {"collectives": [_call("broadcast", 1)], "steps": []} for r in range(NPROC)})
    assert ex2_by_hand._same_broadcast_hang(hung) and ex2_by_hand._broadcast_everywhere(hung)
    elsewhere = SimpleNamespace(records={0: {"collectives": [_call("broadcast", 1)], "steps": []},
                                         1: {"collectives": [_call("all_reduce", 1, "ex2_by_hand.py:42")], "steps": []}})
    assert not ex2_by_hand._same_broadcast_hang(elsewhere)  # a collective only one rank calls: the hang hint
    copied = SimpleNamespace(records={r: {"collectives": [_call("broadcast", 1), _call("broadcast", 3), _call("broadcast", 5)],
                                          "steps": [2, 4, 6]} for r in range(NPROC)})
    assert ex2_by_hand._gradients_broadcast(copied)
    averaged = {r: {"collectives": [_call("broadcast", 1), _call("all_reduce", 3)], "steps": [2, 4]} for r in range(NPROC)}
    assert not ex2_by_hand._gradients_broadcast(SimpleNamespace(records=averaged))
    dropped = {r: {"collectives": [_call("all_reduce", 1, asynchronous=True)], "steps": [2]} for r in range(NPROC)}
    assert fails(check_waits, dropped).diagnosis == "not-waited"
    for key, diagnosis in (("2", "src-differs"), ("2", "broadcast-grads"), ("2", "not-waited")):
        assert diagnosis in EXERCISES[key].hints


def test_ex5_parameters_averaged_after_the_step_even_with_the_gradients_averaged():
    def recs(*alls):
        return {r: {"collectives": [_call("all_reduce", t) for t in alls], "steps": [2, 4]} for r in range(NPROC)}
    assert ex5_zero1._averaged_after_step(recs(1, 3, 5))  # gradients before each step, parameters after the last
    assert ex5_zero1._averaged_after_step(recs(5))
    assert not ex5_zero1._averaged_after_step(recs(1, 3))  # gradients only: the owners broadcast


def test_ex6c_ranks_that_differ_after_a_step_are_named_no_sync():
    ref = ex6_debug.reference_c()
    apart = [[p + 0.1 for p in params] for params in ref.params]
    traces = [{"names": ref.names, "params": ref.params, "losses": ref.losses},
              {"names": ref.names, "params": [ref.params[0], *apart[1:]], "losses": ref.losses}]
    run = Run(0, "", {}, None, 1.0)
    with mock.patch.object(ex6_debug, "launch", return_value=run), mock.patch.object(ex6_debug, "failure"), \
            mock.patch.object(ex6_debug, "load_traces", return_value=traces):
        verdict = fails(ex6_debug.check_accumulation, None, None, backend="gloo", timeout=1)
    assert verdict.diagnosis == "unsynced" and "no_sync" in EXERCISES["6c"].hints_for("unsynced")[0]


# ------------------------------------------------------------------ exercise 7: which ranks agree, and the factor
def _ex7_saved(ref: dict) -> list[dict]:
    """What each rank saves for a correct run: contiguous slices of the unsplit MLP."""
    units = torch.arange(ref["fc_weight"].shape[0]).chunk(NPROC)
    return [{"out": ref["out"].clone(), "x_grad": ref["x_grad"].clone(), "fc_weight": ref["fc_weight"][u],
             "proj_weight": ref["proj_weight"][:, u], "fc_weight_grad": ref["fc_weight_grad"][u],
             "fc_bias_grad": ref["fc_bias_grad"][u], "proj_weight_grad": ref["proj_weight_grad"][:, u],
             "proj_bias_grad": ref["proj_bias_grad"].clone()} for u in units]


def test_ex7_names_a_divided_backward_and_a_sum_on_one_rank():
    ref = ex7_tp.reference(**ex7_tp.CONFIG)
    assert ex7_tp.diagnose(_ex7_saved(ref), ref).status == "pass"
    halved = _ex7_saved(ref)
    for mine in halved:
        for name in ("x_grad", "fc_weight_grad", "fc_bias_grad", "proj_weight_grad", "proj_bias_grad"):
            mine[name] = mine[name] / NPROC
    assert fails(ex7_tp.diagnose, halved, ref).diagnosis == "backward-divided"
    reduced = _ex7_saved(ref)
    reduced[1]["out"] = reduced[1]["out"] * 0.3
    assert fails(ex7_tp.diagnose, reduced, ref).diagnosis == "reduce-one-rank"
    reduced = _ex7_saved(ref)
    reduced[1]["x_grad"] = reduced[1]["x_grad"] * 0.3
    assert fails(ex7_tp.diagnose, reduced, ref).diagnosis == "reduce-one-rank"



def test_ex7_a_gradient_saved_as_none_is_not_told_to_keep_the_save():
    """Issue 55: a gradient that never arrives (saved as None) named as such, its causes listed; a value the
    script did not save at all is still "keep the torch.save"."""
    ref = ex7_tp.reference(**ex7_tp.CONFIG)
    none = _ex7_saved(ref)
    none[0]["fc_weight_grad"] = None
    verdict = fails(ex7_tp.diagnose, none, ref)
    first = ex7_tp.HINTS[verdict.diagnosis][0]
    assert verdict.diagnosis == "grad-none" and "fc_weight_grad as None" in verdict.symptom, verdict.symptom
    assert "torch.save" not in first and "nn.Parameter" in first and "returned None" in first
    missing = _ex7_saved(ref)
    del missing[0]["fc_weight_grad"]
    assert fails(ex7_tp.diagnose, missing, ref).diagnosis == "no-output"


# ------------------------------------------------------------------ exercise 9: what came back
def test_ex9_names_dropped_tokens_and_inputs_sent_back():
    ref = ex9_experts.reference(24, 3)
    inputs = [{**want, "y": want["gate"][:, None] * want["x"]} for want in ref]
    assert fails(ex9_experts.diagnose, inputs, ref).diagnosis == "combine-inputs"
    dropped = [{**want, "y": want["y"].clone()} for want in ref]
    dropped[0]["y"][::3] = 0
    assert fails(ex9_experts.diagnose, dropped, ref).diagnosis == "dropped"
    flat = [{**want, "y": want["y"].sum(1)} for want in ref]  # another shape, no crash of the check: named as a shape
    assert fails(ex9_experts.diagnose, flat, ref).diagnosis == "out-shape"
    assert crashes.kind("ValueError: Expected input batch_size (192) to match target batch_size (64).") == "crash-shape"


# ------------------------------------------------------------------ the benchmark's classes
def test_bench_classes_each_first_rung():
    assert bench_checker.first_rung(False, "crash-name", right=True) == "named"
    assert bench_checker.first_rung(False, "crash", right=False) == "generic" and "crash" in GENERIC
    assert bench_checker.first_rung(False, "lr", right=False) == "misleading"
    assert bench_checker.first_rung(True, "pass", right=False) == "passed"
