"""DataParallel (notebook 02): train_dp.py's run in the notebook, its checkpoint, and the properties the
notebook demonstrates (manual DP gives the full-batch gradient; on CPU DP is a silent pass-through;
the ring all-reduce simulation gives the sum and sends 2(N-1)/N of the tensor per rank)."""

import copy
import math
import re
import warnings

import pytest
import torch
from conftest import executed_notebook
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import course
from course.checkpoint import load_checkpoint
from course.launcher import launch
from course.models import mlp
from course.scriptdiff import script_diff


def test_train_dp_runs_as_one_process_and_saves_plain_keys():
    """Read from notebook 02's headless run (quick: 100 steps on MNIST), which launches train_dp.py once."""
    run = executed_notebook("02_data_parallel").require_ok()
    m = run.metrics("mnist_dp")
    assert m["world_size"] == 1 and m["steps"] == 100 and m["samples_per_s"] > 0
    assert [step for step, _ in m["train_loss_history"]] == list(range(10, 101, 10))
    assert not any(math.isnan(loss) for _, loss in m["train_loss_history"])
    assert m["dp_device_ids"] == list(range(torch.cuda.device_count()))
    assert 0.5 < m["val_accuracy"] <= 1.0 and m["val_total"] == 10000
    assert "DataParallel device_ids=" in run.output()

    state = load_checkpoint(run.written(course.WEIGHTS / "train_dp.pt"))
    assert state["step"] == 100
    assert not [key for key in state["model"] if key.startswith("module.")]
    mlp().load_state_dict(state["model"])  # strict: a plain model takes the checkpoint as it is


@pytest.mark.parametrize("devices,batch", [(2, 64), (4, 64), (3, 10)])  # (3, 10): uneven chunks 4, 4, 2
def test_manual_data_parallel_step_gives_the_full_batch_gradient(devices, batch):
    """Notebook 02's hand-made DP step: chunk, copy, forward, concatenate, one loss, sum the gradients."""
    torch.manual_seed(0)
    images, labels = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    master = mlp()
    single = copy.deepcopy(master)
    nn.functional.cross_entropy(single(images), labels).backward()

    chunks = torch.chunk(images, devices)
    replicas = [copy.deepcopy(master) for _ in chunks]
    outputs = torch.cat([replica(chunk) for replica, chunk in zip(replicas, chunks)])
    nn.functional.cross_entropy(outputs, labels).backward()
    for name, param in master.named_parameters():
        param.grad = sum(dict(replica.named_parameters())[name].grad for replica in replicas)

    gap = max((p.grad - q.grad).abs().max().item() for p, q in zip(master.parameters(), single.parameters()))
    assert gap <= 1e-6


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the pass-through happens only without GPUs")
def test_dataparallel_without_gpus_is_a_silent_pass_through_with_prefixed_keys():
    plain = mlp()
    images = torch.randn(8, 1, 28, 28)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = nn.DataParallel(plain)
        out = wrapped(images)
    assert wrapped.device_ids == [] and caught == []
    assert torch.equal(out, plain(images))

    state = wrapped.state_dict()
    assert all(key.startswith("module.") for key in state)
    with pytest.raises(RuntimeError, match="Missing key"):
        mlp().load_state_dict(state)
    consume_prefix_in_state_dict_if_present(state, "module.")
    mlp().load_state_dict(state)


def test_train_dp_refuses_more_than_one_process(datasets, tmp_path):
    """Started as 2 ranks, every copy stops before training with argparse's one error line (exit status 2)."""
    result = launch("train_dp.py", nproc=2, timeout=120, run_dir=tmp_path / "run", check=False, quiet=True,
                    on_line=lambda _: None, args=["--max-steps", 1, "--checkpoint", tmp_path / "never.pt"])
    assert result.returncode != 0 and re.search(r"exitcode\s*: 2\b", result.output), result.output[-3000:]
    said = {line.split(":", 1)[1] for line in result.output.splitlines() if re.match(r"\[rank\d\]:.*error:", line)}
    refusal = "train_dp.py: error: train_dp.py is one process for all GPUs (DP); for several processes, use train_ddp.py"
    assert said == {refusal}, result.output[-3000:]
    assert not (tmp_path / "never.pt").exists() and "training images" not in result.output


def test_train_dp_differs_from_train_single_only_in_marked_lines():
    diff = script_diff("train_single.py", "train_dp.py", marker=r"\bDP\b|DataParallel", context=0)
    assert diff.hunks and not diff.unmarked, diff.unmarked
    assert "nn.DataParallel(model)" in diff.text() and "model.module.state_dict()" in diff.text()
    dp = (course.SCRIPTS / "train_dp.py").read_text()  # plain, like train_single.py: no course module
    assert "from course" not in dp and "import course" not in dp


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("length", [1, 8, 10, 13])
def test_ring_all_reduce_simulation_gives_the_sum_on_every_rank(ranks, length):
    ring = course.import_script("ring_allreduce")
    tensors = [ring.rank_tensor(r, length) for r in range(ranks)]
    phases = ring.simulate_ring_all_reduce(tensors)
    assert len(phases) == 1 + 2 * (ranks - 1)  # the start, N-1 reduce-scatter and N-1 all-gather steps
    for chunks in phases[-1]["chunks"]:
        assert torch.equal(torch.cat(chunks), sum(tensors))
    assert torch.equal(torch.cat(phases[0]["chunks"][0]), tensors[0])  # the inputs are not modified
    if length % ranks == 0:
        assert ring.elements_sent(phases) == [2 * (ranks - 1) * length // ranks] * ranks


def test_ring_view_highlights_what_each_rank_just_received():
    from course.ring_view import phase_html, phase_lines

    ring = course.import_script("ring_allreduce")
    phases = ring.simulate_ring_all_reduce([ring.rank_tensor(r, 3) for r in range(3)])
    first_step = phase_html(phases, 1, ring.elements_sent(phases[:2]))
    assert first_step.count("+= from rank") == 3 and "phase 1 of 4: reduce-scatter 1/2" in first_step
    last = phase_html(phases, 4, ring.elements_sent(phases))
    assert last.count("= from rank") == 3 and "+=" not in last
    lines = phase_lines(phases)
    assert len(lines) == 5 and lines[-1].count("6|12|18") == 3  # every rank ends with the sum
