"""Notebook 05's scripts and helpers: all-reduce bandwidth arithmetic, accumulation equivalence and its two bugs,
the all-reduce/byte counter, the profiler trace and its timeline, and the GPU-only cells skipping on a CPU.
Physics and structure only: no assertion on wall-clock speed. What the scripts measure is read from notebook
05's own headless run, which launches each of them once."""

import json
from pathlib import Path

import nbformat
import pytest
import torch
from conftest import executed_notebook

from course import ROOT, import_script
from course.models import build_model
from course.timeline import Timeline, intersect, load_timeline, load_timelines, merge, subtract, total

NOTEBOOK = ROOT / "notebooks" / "05_performance.ipynb"


# ------------------------------------------------------------------------------------------- arithmetic


def test_bus_bandwidth_is_the_nccl_tests_definition():
    bench = import_script("bench_allreduce")
    assert bench.bus_bandwidth(1.0, 2) == 1.0  # 2(n-1)/n = 1 for two ranks
    assert bench.bus_bandwidth(2.0, 4) == pytest.approx(3.0)
    assert bench.bus_bandwidth(1.0, 8) == pytest.approx(1.75)


def test_interval_arithmetic():
    assert merge([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    assert total([(0, 2), (1, 3), (5, 6)]) == 4
    assert intersect([(0, 10)], [(2, 3), (8, 12)]) == [(2, 3), (8, 10)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert subtract([(0, 10), (20, 30)], [(-5, 1), (25, 40)]) == [(1, 10), (20, 25)]


def _event(name, ts_ms, dur_ms, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts_ms * 1000, "dur": dur_ms * 1000, "tid": tid, "pid": 1, "cat": cat}


def test_timeline_overlap_from_a_synthetic_trace(tmp_path):
    """Backward computes 0-10 ms (minus a 1 ms c10d launch at 4-5); the all-reduce runs 4-14 ms on gloo's thread
    and its span runs on into the next step (to 16 ms): clipped to backward's end (12 ms)."""
    events = [_event("forward", -5, 5, cat="user_annotation"), _event("backward", 0, 12, cat="user_annotation"),
              _event("autograd::engine::evaluate_function: AddmmBackward0", 0, 4),
              _event("autograd::engine::evaluate_function: AccumulateGrad", 4, 6),
              _event("c10d::allreduce_", 4, 1),
              _event("gloo:all_reduce", 4, 12, tid=2, cat="user_annotation"),
              _event("gloo:broadcast", -5, 1, tid=2, cat="user_annotation"),
              _event("optimizer", 12, 2, cat="user_annotation"),
              _event("autograd::engine::evaluate_function: AddmmBackward0", 13, 1)]  # outside backward: ignored
    path = tmp_path / "rank1.json"
    path.write_text(json.dumps({"distributedInfo": {"rank": 1}, "traceEvents": events}))
    t = load_timeline(path)
    assert isinstance(t, Timeline) and t.rank == 1
    assert t.spans["all-reduce"] == [(4.0, 12.0)]
    assert t.compute == [(0.0, 4.0), (5.0, 10.0)]
    assert t.overlap_fraction() == pytest.approx(5 / 8)  # overlapped 5-10 of 4-12
    assert t.busy("broadcast") == 1 and t.busy("forward") == 5 and t.busy("optimizer") == 2


# ------------------------------------------------------------------------------------------- real runs
# Read from notebook 05's own headless run (conftest.executed_notebook): it launches each of these scripts once.

TRACE_STEPS = 3  # perf_step.py's --trace-steps default, which notebook 05's ResNet-18 run uses


@pytest.fixture(scope="module")
def notebook_05():
    """Notebook 05's headless run (shared with tests/test_notebooks.py); the tests below read what it wrote."""
    return executed_notebook("05_performance").require_ok()


def test_bench_allreduce_algbw_busbw_and_copy(notebook_05):
    m = notebook_05.metrics("allreduce")  # bench_allreduce.py --max-mb 64 (quick)
    rows, n = m["results"], m["world_size"]
    assert n == 2 and [r["bytes"] for r in rows] == [4096 * 4**i for i in range(len(rows))]
    assert rows[-1]["bytes"] == 64 * 2**20
    for r in rows:
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (n - 1) / n)
        assert r["calls"] >= 3 and r["time_s"] > 0 and r["copy_GBps"] > 0
    # Between processes of one machine every byte crosses memory at least once: an all-reduce cannot carry
    # much more than a local copy of the same size moves (2x: margin for timing noise).
    assert rows[-1]["busbw_GBps"] <= 2 * rows[-1]["copy_GBps"]


def test_accumulation_equivalence_catches_both_bugs(notebook_05):
    m = notebook_05.metrics("accumulation")  # --micro-steps 4 --batch-size 16 --steps 5
    k = m["micro_steps"]
    assert (m["world_size"], k, m["global_batch"]) == (2, 4, 2 * 4 * 16)
    right, no_divide, every = (m["results"][v] for v in ("right", "no_divide", "sync_every_step"))
    assert right["max_param_diff"] <= 1e-6  # N x K x B == one process with N*K*B
    assert no_divide["max_param_diff"] > 1e-3  # bug 1: caught by the equivalence check
    assert every["max_param_diff"] <= 1e-6  # bug 2 trains right ...
    assert right["all_reduces_per_step"] == 1 and every["all_reduces_per_step"] == k  # ... caught by the counter
    assert every["bytes_per_step"] == k * right["bytes_per_step"] == k * 4 * 101_770
    assert set(m["timing"]["values"]) == {"right", "sync_every_step"}  # timed through course.measure


def test_precision_bytes_dtypes_and_loss(notebook_05):
    m = notebook_05.metrics("precision")  # --steps 30 (quick)
    params, results = m["parameters"], m["results"]
    assert params == 101_770 and m["steps"] == 30
    assert results["fp32"]["bytes_per_step"] == results["autocast"]["bytes_per_step"] == 4 * params
    assert results["autocast"]["dtypes"]["parameters"] == results["autocast"]["dtypes"]["gradients"] == "torch.float32"
    assert results["autocast"]["dtypes"]["output"] in ("torch.bfloat16", "torch.float16")
    for hook in ("fp16_hook", "bf16_hook"):
        if "unavailable" in results[hook]:  # bf16 on a build without CUDA + NCCL: refused by name
            assert hook == "bf16_hook" and "BF16" in results[hook]["unavailable"]
            continue
        assert results[hook]["bytes_per_step"] == 2 * params and results[hook]["all_reduces_per_step"] == 1
    for name, r in results.items():
        if "loss" in r:
            assert len(r["loss"]) == m["steps"] and r["max_loss_diff"] <= 0.02, name


def test_step_counts_trace_and_timeline(notebook_05, tmp_path):
    mlp = notebook_05.metrics("step_mlp")  # sync,no_sync + the unused-parameter demo
    configs = mlp["configs"]
    assert configs["no_sync"]["all_reduces_per_step"] == 0 and configs["no_sync"]["bytes_per_step"] == 0
    assert configs["sync"]["all_reduces_per_step"] == 1 and configs["sync"]["bytes_per_step"] == mlp["gradient_bytes"]
    assert configs["sync"]["gradient_storages"] == 4  # 2 weights + 2 biases
    assert set(mlp["timing"]["values"]) == {"sync", "no_sync"}
    assert mlp["unused_demo"]["default"].startswith("Expected to have finished reduction")
    assert mlp["unused_demo"]["find_unused_parameters"] == mlp["unused_demo"]["static_graph"] == "ok"

    resnet = notebook_05.metrics("step_resnet18")  # seven DDP options, and a profiler trace of the first
    configs = resnet["configs"]
    assert set(resnet["timing"]["values"]) == set(configs) == {
        "sync", "no_sync", "bucket1", "bucket100", "view", "static", "find_unused"}
    tensors = len(list(build_model("resnet18", 5).parameters()))
    assert configs["view"]["gradient_storages"] < configs["sync"]["gradient_storages"] == tensors  # views into buckets
    assert configs["bucket1"]["all_reduces_per_step"] > configs["sync"]["all_reduces_per_step"] >= 1
    assert all(c["bytes_per_step"] == resnet["gradient_bytes"] for name, c in configs.items() if name != "no_sync")

    trace = notebook_05.written(Path(resnet["trace"]) / "rank0.json").parent
    assert sorted(p.name for p in trace.glob("*.json")) == ["rank0.json", "rank1.json"]
    timelines = load_timelines(trace)
    assert list(timelines) == [0, 1]
    for t in timelines.values():
        assert len(t.spans["forward"]) == len(t.spans["backward"]) == len(t.spans["optimizer"]) == TRACE_STEPS
        assert len(t.spans["all-reduce"]) >= 1 and t.compute
        assert 0 <= t.overlap_fraction() <= 1
        backward = t.spans["backward"]
        assert intersect(t.spans["all-reduce"], backward) == t.spans["all-reduce"]  # clipped to backward

    import matplotlib

    matplotlib.use("Agg")
    from course.timeline import draw

    figure = draw(timelines)
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == [
        "rank 0 step", "rank 0 comm", "rank 1 step", "rank 1 comm"]
    figure.savefig(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------------- the notebook


def test_notebook_writes_its_scripts_and_tags_its_special_cells():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    written = [c.source.partition("\n")[0] for c in nb.cells if c.source.startswith("%%writefile")]
    assert written == [f"%%writefile ../scripts/{name}" for name in
                       ("perf_precision.py", "perf_accumulation.py", "perf_step.py", "bench_allreduce.py")]
    tagged = [c for c in nb.cells if {"gpu-only", "skips-in-quick"} & set(c.metadata.get("tags", []))]
    assert len(tagged) == 3 and all("skipped" in c.source for c in tagged)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine these cells run instead of skipping")
def test_gpu_only_cells_skip_with_a_reason_on_a_cpu(notebook_05):
    """Every cell tagged gpu-only or skips-in-quick, as notebook 05's headless run (quick, CPU) left it."""
    executed = nbformat.read(notebook_05.executed, as_version=4)
    special = [c for c in executed.cells if {"gpu-only", "skips-in-quick"} & set(c.metadata.get("tags", []))]
    assert len(special) == 3
    for cell in special:
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        lines = text.splitlines()
        assert lines and lines[0].startswith("skipped"), text  # one sentence, why
        assert all(line.startswith("published, not measured here: ") for line in lines[1:]), text  # the GPU picture


# ------------------------------------------------------------------------------------------- the step model

def test_step_model_never_predicts_more_than_n_and_names_what_it_cannot_see():
    from course.scaling_model import StepModel

    # a rank faster without communication than the one process (threads used badly by the one process)
    fast = StepModel(2, t1=1.0, t_no_sync=0.3, t_sync=0.4, t_comm=0.05, overlap=0.5, threads=(2, 1))
    assert fast.predicted() <= 2 and fast.predicted(0) <= 2 and fast.measured == 5.0
    assert not fast.lands() and any("how well 1 process uses 2 thread(s)" in line for line in fast.report(True))
    assert "measured 5.00x (1 run of 1 process, 1 of 2; whether it is a speed-up" in fast.report(True)[0]
    rounds = StepModel(2, t1=1.0, t_no_sync=0.3, t_sync=0.4, t_comm=0.05, overlap=0.5, runs=(5, 5))
    assert "measured 5.00x (medians of 5 run(s) of 1 process and 5 of 2;" in rounds.report(True)[0]  # issue 33 §3
    # pieces that add up: (1 - f) * T_comm == T_sync - T_no_sync, compute no faster than one process
    exact = StepModel(2, t1=0.1, t_no_sync=0.12, t_sync=0.14, t_comm=0.04, overlap=0.5)
    assert abs(exact.exposed - (exact.t_sync - exact.t_no_sync)) < 1e-12
    assert abs(exact.predicted() - exact.measured) < 1e-12 and exact.lands()
    assert any("within 20%" in line for line in exact.report(True))
    # overlap that hid nothing on a shared CPU: f = 0 lands, the measured f does not
    hidden = StepModel(2, t1=0.1, t_no_sync=0.1, t_sync=0.2, t_comm=0.1, overlap=0.9)
    assert not hidden.lands() and hidden.lands(0)
    assert any("with f = 0 it is within" in line for line in hidden.report(True))
    # time no piece holds, on a shared CPU
    unseen = StepModel(2, t1=0.1, t_no_sync=0.1, t_sync=0.3, t_comm=0.02, overlap=0.5)
    assert any("gloo threads on the same CPU cores" in line for line in unseen.report(True))
    assert any("no piece of the model holds" in line for line in unseen.report(False))
