"""Notebook 08: the memory prediction, measured bytes per rank (DDP, ZeRO-1, ZeRO-2-like, FSDP2), collective
counts, FSDP2 = single-process training, DCP checkpoints saved on N ranks and loaded on 1, exported to a plain
file. The measured facts are read from notebook 08's own headless run (conftest.executed_notebook)."""

import pytest
import torch
from conftest import executed_notebook, run

from course import ROOT, WEIGHTS
from course.launcher import LaunchError
from course.models import build_model
from course.scriptdiff import script_diff
from course.sharding import STRATEGIES, CollectiveCounter, blocks, local_bytes, model_states, predict

TOLERANCE = 0.02  # what notebook 08 states: measured model states within 2 % of the prediction


def test_prediction_is_the_zero_table():
    psi, n = 1e9, 8
    p = {s: model_states(v) for s, v in predict(psi, n).items()}
    assert p == {"DDP": 16 * psi, "ZeRO-1": 8 * psi + 8 * psi / n, "ZeRO-2-like": 4 * psi + 16 * psi / n,
                 "FSDP2": 16 * psi / n}
    assert predict(psi, n)["DDP"]["working copies"] == 0
    assert predict(psi, n, blocks=10)["FSDP2"]["working copies"] == 2 * 4 * psi / 10  # two gathered blocks
    bf16 = predict(psi, n, bf16=True, blocks=10)
    assert bf16["DDP"]["working copies"] == bf16["ZeRO-1"]["working copies"] == 2 * psi  # autocast's copies
    assert model_states(bf16["FSDP2"]) == p["FSDP2"]  # the fp32 master shards stay
    assert model_states(bf16["ZeRO-2-like"]) == 16 * psi / n and bf16["ZeRO-2-like"]["working copies"] == 2 * psi
    assert model_states(predict(psi, 1)["DDP"]) == model_states(predict(psi, 64)["DDP"])  # never lower


def test_local_bytes_counts_each_storage_once():
    a = torch.zeros(1000)
    assert local_bytes([a, a[:10], a.view(10, 100), None]) == 4000
    assert local_bytes([a, torch.zeros(10, dtype=torch.bfloat16)]) == 4020
    assert local_bytes([a], exclude={a.untyped_storage().data_ptr()}) == 0


def test_blocks_of_the_course_models():
    assert [type(b).__name__ for b in blocks(build_model("mlp", 10))] == ["Linear", "Linear"]
    assert len(blocks(build_model("cnn", 5))) == 4  # three conv blocks and the head
    assert [type(b).__name__ for b in blocks(build_model("resnet18", 5))] == ["BasicBlock"] * 8


def test_collective_counter_sees_c10d_calls():
    import torch.distributed as dist

    from course.launcher import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with CollectiveCounter() as counter:
            dist.all_reduce(torch.ones(256))
            dist.broadcast(torch.ones(10), src=0)
            torch.ones(3) + 1  # not a collective
    finally:
        dist.destroy_process_group()
    summary = counter.summary(world_size=2)
    assert set(summary) == {"all-reduce", "broadcast"}
    assert summary["all-reduce"]["calls"] == 1 and summary["all-reduce"]["payload_bytes"] == 1024
    assert summary["all-reduce"]["sent_bytes"] == 1024  # 2(N-1)/N of the payload with N = 2


def test_train_fsdp_is_train_ddp_plus_six_marked_steps():
    diff = script_diff("train_ddp.py", "train_fsdp.py", marker=r"FSDP step (\d)")
    assert diff.steps == {1, 2, 3, 4, 5, 6}
    assert not diff.unmarked, diff.unmarked


def test_notebook_08_step_cells_quote_the_script():
    """Every code line section 3 of notebook 08 shows is in train_fsdp.py (so they cannot drift apart), and its
    six steps are there in order."""
    import nbformat

    script = (ROOT / "scripts" / "train_fsdp.py").read_text()
    cells = [c.source for c in nbformat.read(ROOT / "notebooks" / "08_sharding_fsdp.ipynb", as_version=4).cells
             if c.cell_type == "markdown" and "### Step 1:" in c.source]
    assert len(cells) == 1
    assert [line.split(":")[0] for line in cells[0].splitlines() if line.startswith("### Step ")] == \
        [f"### Step {n}" for n in range(1, 7)]
    blocks_shown = [part.split("```", 1)[0] for part in cells[0].split("```python\n")[1:]]
    assert len(blocks_shown) == 4  # steps 1, 3, 5 and 6
    for block in blocks_shown:
        for line in block.splitlines():
            for fragment in line.split("  #", 1)[0].strip().split("..."):
                fragment = fragment.strip(" ,()")
                assert fragment in script, f"{fragment!r} is not in train_fsdp.py"


def test_fsdp_checkpoint_builds_train_fsdps_models():
    """fsdp_checkpoint.py loads what train_fsdp.py saved only if it builds the same modules: its model lines
    are the script's, for both --model choices."""
    lines = {name: [line.strip() for line in (ROOT / "scripts" / name).read_text().splitlines()]
             for name in ("train_fsdp.py", "fsdp_checkpoint.py")}
    model = [line for line in lines["train_fsdp.py"] if line.startswith(("model = nn.Sequential(", "nn."))]
    assert len(model) == 4 and all(line in lines["fsdp_checkpoint.py"] for line in model), model


@pytest.fixture(scope="module")
def notebook_08():
    """Notebook 08's headless run (shared with tests/test_notebooks.py): shard_memory.py on ResNet-18 and the
    FSDP2-vs-one-process runs; the tests below read what they wrote (on 2 ranks here, 4 on 4+ cores)."""
    return executed_notebook("08_sharding_fsdp").require_ok()


@pytest.fixture(scope="module")
def memory(notebook_08):
    return notebook_08.metrics("memory")


def test_measured_bytes_per_rank_match_the_prediction(memory):
    psi, measured = memory["psi"], memory["measured"]
    assert psi == sum(p.numel() for p in build_model("resnet18", 5).parameters())
    n = len(measured["DDP"])
    predicted = predict(psi, n, blocks=memory["groups"])
    for strategy in STRATEGIES:
        assert len(measured[strategy]) == n >= 2
        for rank in measured[strategy]:
            gap = model_states(rank) / model_states(predicted[strategy]) - 1
            assert abs(gap) <= TOLERANCE, (strategy, gap)
            assert rank["activations"] > 0
    ddp, fsdp = measured["DDP"][0], measured["FSDP2"][0]
    assert ddp["parameters"] == ddp["gradients"] == 4 * psi  # replicated, exactly
    assert abs(model_states(fsdp) / model_states(ddp) - 1 / n) < 0.001  # FSDP2 on n ranks: 1/n
    assert ddp["ddp_bucket_bytes"] == pytest.approx(4 * psi, rel=0.01)  # a second copy of the gradients


def test_zero2_like_holds_whole_parameters_and_its_shard(memory):
    """What figure 08_zero_stages says under it: fully_shard with reshard_after_forward=False keeps the whole
    parameters and its own shard (4Ψ + 16Ψ/N, 12Ψ at N = 2, as much as ZeRO-1), not the paper's 4Ψ + 12Ψ/N."""
    psi, measured = memory["psi"], memory["measured"]
    n = len(measured["DDP"])
    zero2, zero1 = measured["ZeRO-2-like"][0], measured["ZeRO-1"][0]
    assert zero2["parameters"] == pytest.approx(4 * psi + 4 * psi / n, rel=0.01)
    assert zero2["gradients"] == pytest.approx(4 * psi / n, rel=0.01)
    assert model_states(zero2) == pytest.approx(4 * psi + 16 * psi / n, rel=0.01)
    if n == 2:  # 12 psi: as much as ZeRO-1
        assert model_states(zero2) == pytest.approx(model_states(zero1), rel=0.01)
    assert model_states(zero2) > 1.1 * (4 * psi + 12 * psi / n)  # more than the paper's stage 2
    figure = (ROOT / "notebooks" / "figures" / "08_zero_stages.svg").read_text()
    assert "ZeRO-2 (paper)" in figure and "4Ψ + 16Ψ/N, 12Ψ at N = 2" in figure
    for n in (2, 4, 8):
        assert model_states(predict(1, n)["ZeRO-2-like"]) == pytest.approx(4 + 16 / n)


def test_collectives_per_step(memory):
    psi, groups = memory["psi"], memory["groups"]
    calls = {s: {k: v["calls"] for k, v in memory["measured"][s][0]["collectives"].items()} for s in STRATEGIES}
    payload = {s: {k: v["payload_bytes"] for k, v in memory["measured"][s][0]["collectives"].items()}
               for s in STRATEGIES}
    assert payload["DDP"]["all-reduce"] == pytest.approx(4 * psi, rel=0.001)  # every gradient, in buckets
    assert "all-gather" not in calls["DDP"]
    tensors = len(list(build_model("resnet18", 5).parameters()))
    assert calls["ZeRO-1"]["broadcast"] == calls["DDP"].get("broadcast", 0) + tensors  # each updated parameter
    assert calls["FSDP2"] == {"all-gather": 2 * groups, "reduce-scatter": groups}  # forward + backward
    assert calls["ZeRO-2-like"] == {"all-gather": groups, "reduce-scatter": groups}  # no re-gather in backward
    assert payload["FSDP2"]["all-gather"] == pytest.approx(8 * psi, rel=0.001)


def test_timing_goes_through_compare(memory):
    timing = memory["timing"]
    assert set(timing["comparison"]["values"]) == {"DDP", "FSDP2"}
    assert timing["comparison"]["unit"] == "s/step" and timing["comparison"]["higher_is_better"] is False
    assert set(timing["collective_seconds"]) == {"all-reduce", "all-gather", "reduce-scatter"}
    assert timing["verdict"].startswith("FSDP2:")


def test_fsdp2_trains_the_same_model_as_one_process(notebook_08, tmp_path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from course.dcp_check import dcp_to_torch_save, problem, read_metadata  # weights-only for non-tensors

    single, fsdp = notebook_08.metrics("equivalence/single"), notebook_08.metrics("equivalence/fsdp")
    n, dcp = fsdp["world_size"], WEIGHTS / "08_sharding_fsdp" / "train_fsdp"
    assert n >= 2 and fsdp["global_batch"] == 64 and fsdp["bf16"] is False
    assert sorted(p.name for p in dcp.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(n)), "sha256.json"]
    notebook_08.written(dcp / ".metadata")
    kinds = read_metadata(dcp).state_dict_metadata  # epoch and step saved as tensors: no pickle to unpickle
    assert all(isinstance(kinds[k], TensorStorageMetadata) for k in ("epoch", "step")) and problem(dcp) is None
    losses = list(zip(single["train_loss_history"], fsdp["train_loss_history"]))
    steps = len(losses)
    assert steps >= 20 and max(abs(a[1] - b[1]) / a[1] for a, b in losses) <= 1e-4
    dcp_to_torch_save(dcp, tmp_path / "joined.pt")
    joined = torch.load(tmp_path / "joined.pt", weights_only=True)
    reference = torch.load(notebook_08.weights("train_single.pt"), weights_only=True)["model"]
    assert joined["step"] == steps and joined["model"].keys() == reference.keys()
    assert max((joined["model"][k] - reference[k]).abs().max().item() for k in reference) <= 1e-5


def test_checkpoint_saved_on_two_ranks_loads_on_one_and_exports_a_plain_file(notebook_08):
    fsdp, loaded = notebook_08.metrics("equivalence/fsdp"), notebook_08.metrics("checkpoint_on_1")
    assert loaded["world_size"] == 1 and loaded["saved_pieces"] == fsdp["world_size"]
    assert loaded["step"] == len(fsdp["train_loss_history"])
    assert loaded["val_correct"] == fsdp["val_correct"] and loaded["val_total"] == fsdp["val_total"]
    state = torch.load(notebook_08.weights("train_fsdp_model.pt"), map_location="cpu", weights_only=True)
    model = build_model("mlp", 10)
    model.load_state_dict(state["model"])  # strict: a plain model, no prefixes, no DTensors
    assert all(type(t) is torch.Tensor for t in state["model"].values())


def test_not_a_checkpoint_is_one_clear_error(datasets, tmp_path):
    with pytest.raises(LaunchError) as error:
        run("fsdp_checkpoint.py", 1, [tmp_path], tmp_path / "run")
    assert f"checkpoint {tmp_path}" in str(error.value) and "no .metadata" in str(error.value)  # dcp_check's line


def test_notebook_08_writes_its_scripts():
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "08_sharding_fsdp.ipynb", as_version=4)
    written = {c.source.split("\n", 1)[0] for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%")}
    assert written == {f"%%writefile ../scripts/{name}"
                       for name in ("shard_memory.py", "train_fsdp.py", "fsdp_checkpoint.py")}
