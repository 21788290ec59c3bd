"""The one device/backend rule (course.hardware), with the accelerator report faked: CUDA x0/1/2, MPS x1,
XPU x2, for 1 and 2 processes; plan() reports what the rule decides; the launcher plans a CPU job
without importing torch."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed import Backend

from course import SCRIPTS
from course.hardware import CPU_BACKEND, backend_for, choose, describe, pick_device
from course.launcher import plan
from ddp_doctor import hardware

# (accelerator report, processes) -> (device type the ranks use, their backend)
RANKS = {
    ((None, 0), 1): ("cpu", "gloo"), ((None, 0), 2): ("cpu", "gloo"),
    (("cuda", 1), 1): ("cuda", "nccl"), (("cuda", 1), 2): ("cpu", "gloo"),
    (("cuda", 2), 1): ("cuda", "nccl"), (("cuda", 2), 2): ("cuda", "nccl"),
    (("mps", 1), 1): ("cpu", "gloo"), (("mps", 1), 2): ("cpu", "gloo"),
    (("xpu", 2), 1): ("xpu", "xccl"), (("xpu", 2), 2): ("xpu", "xccl"),
}


@pytest.fixture
def fake(monkeypatch):
    """Make this process see the given accelerator report: fake(("cuda", 2)), on a build of PyTorch that has
    every backend (as the faked machine's own build would; this CUDA build has no xccl)."""
    monkeypatch.setattr(hardware, "built", lambda backend: True)
    return lambda report: monkeypatch.setattr(hardware, "accelerator", lambda: report)


@pytest.mark.parametrize(("report", "nproc"), list(RANKS), ids=lambda v: str(v))
def test_rule_for_ranks(report, nproc, fake):
    fake(report)
    chosen = choose(nproc)
    assert (chosen.device_type, chosen.backend) == RANKS[report, nproc], chosen.reason
    launch_plan = plan(nproc)  # what the launcher announces
    plain = "mps" if report[0] == "mps" and nproc == 1 else RANKS[report, nproc][0]  # a plain script may use MPS
    assert (launch_plan.device, launch_plan.backend) == (plain, RANKS[report, nproc][1])
    assert launch_plan.reason and launch_plan.refusal is None


def test_rule_is_pytorchs_map_and_capability_table():
    """Checked against the installed torch: gloo is the CPU default; PyTorch maps mps to gloo, but gloo's
    collectives only take CPU and CUDA tensors, so ranks on a Mac use the CPU."""
    assert CPU_BACKEND == dist.get_default_backend_for_device("cpu")
    assert Backend.default_device_backend_map["mps"] == "gloo"
    assert "mps" not in Backend.backend_capability["gloo"]
    assert hardware.carries("nccl", "cuda") and hardware.carries("xccl", "xpu")
    assert choose(1, ranks=False, report=("mps", 1)).device_type == "mps"
    assert "cannot carry mps tensors" in choose(2, report=("mps", 1)).reason


def test_reasons_say_why(fake):
    assert "no accelerator found" in choose(2, report=(None, 0)).reason
    assert "2 processes > 1 GPU" in choose(2, report=("cuda", 1)).reason
    assert "2 XPU(s) found: one process per XPU, xccl" in choose(2, report=("xpu", 2)).reason
    fake(("mps", 1))
    assert "a script that starts a process group uses gloo on cpu" in plan(1).reason


def test_explicit_backends(fake):
    fake(("cuda", 1))
    with pytest.raises(ValueError, match="nccl needs one GPU per process: 2 processes requested, 1 GPU\\(s\\) found"):
        plan(2, "nccl")
    assert (plan(1, "nccl").device, plan(2, "gloo").device) == ("cuda", "cpu")
    fake(("xpu", 2))
    with pytest.raises(ValueError, match="no GPU found"):
        plan(2, "nccl")
    assert plan(2, "xccl").device == "xpu"
    with pytest.raises(ValueError, match="backend must be"):
        plan(2, "smoke-signals")


def test_a_backend_missing_from_this_build_puts_ranks_on_the_cpu(fake, monkeypatch):
    """Windows: CUDA GPUs, but the wheel has no nccl (torch.distributed.is_backend_available("nccl") is False)."""
    fake(("cuda", 2))
    monkeypatch.setattr(hardware, "built", lambda backend: backend != "nccl")
    chosen = choose(2)
    assert (chosen.device_type, chosen.backend) == ("cpu", "gloo")
    assert chosen.reason == "PyTorch's backend for cuda is nccl, which this build of PyTorch does not have: " \
                            "ranks use gloo on the CPU"
    assert choose(1, ranks=False).device_type == "cuda"  # a plain process needs no backend
    with pytest.raises(ValueError, match="nccl is not in this build of PyTorch"):
        plan(2, "nccl")
    with pytest.raises(ValueError, match="not in this build of PyTorch"):
        backend_for("cuda:0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pick_device(1) == torch.device("cpu")


def test_built_is_what_this_torch_says():
    assert hardware.built("gloo") and hardware.built("nccl") == dist.is_nccl_available()
    assert not hardware.built("no-such-backend")


def test_pick_device_and_backend_for(fake, monkeypatch):
    fake(("cuda", 2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pick_device(1) == torch.device("cuda", 1) and pick_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert pick_device(2) == torch.device("cpu")  # 3 ranks, 2 GPUs: every rank on the CPU
    fake(("mps", 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert pick_device() == torch.device("mps", 0) and pick_device(0) == torch.device("cpu")
    assert backend_for(torch.device("cpu")) == "gloo" and backend_for("cuda:0") == "nccl"
    assert backend_for("xpu") == "xccl"
    with pytest.raises(ValueError, match="cannot carry mps tensors"):
        backend_for("mps")


def test_describe_separates_built_from_usable(fake):
    fake((None, 0))
    info = describe()
    assert info["nccl_built"] == dist.is_nccl_available() and info["nccl_usable"] is False
    assert "2 ranks use" in info and "gloo on cpu" in info["2 ranks use"]
    fake(("cuda", 1))
    assert describe()["nccl_usable"] == dist.is_nccl_available()


def test_planning_a_cpu_job_does_not_import_torch():
    """issue 9: from a cold process the launcher cost ~1.8 s importing torch only to count GPUs."""
    if not hardware._no_accelerator_possible():
        pytest.skip("this machine has accelerator device files: torch is asked")
    code = "import sys; from course.launcher import launch, plan; plan(2); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


# The take-home scripts carry their own few device lines (they cannot import course.hardware): those of
# course/train_utils.py, which a learner copies with them. They are held against the rule for the same faked
# hardware, faked where they ask, in torch.accelerator.
REPORTS = [(None, 0), ("cuda", 0), ("cuda", 1), ("cuda", 2), ("mps", 1), ("xpu", 2)]


@pytest.fixture
def fake_torch(monkeypatch):
    """Make torch.accelerator answer as a machine with this accelerator report would: fake_torch(("cuda", 2))."""
    monkeypatch.setattr(hardware, "built", lambda backend: True)  # as in fake(): the faked machine's own build

    def fake(report):
        kind, count = report
        present = torch.device(kind) if kind and count else None  # check_available: None without a device
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: present)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count if present else 0)
    return fake


@pytest.mark.parametrize("report", REPORTS, ids=str)
def test_the_take_home_device_lines_follow_the_rule(report, fake_torch):
    from course import import_script, train_utils

    fake_torch(report)
    for nproc in (1, 2):
        chosen = choose(nproc, report=report)
        for local_rank in range(nproc):
            device, backend = train_utils.pick_device_and_backend(local_rank, nproc)
            expected = torch.device("cpu") if chosen.device_type == "cpu" else torch.device(chosen.device_type, local_rank)
            assert (device, backend) == (expected, chosen.backend), (report, nproc, chosen.reason)
    chosen = choose(1, ranks=False, report=report)  # one plain process (train_single.py): MPS too
    assert train_utils.pick_device().type == chosen.device_type, chosen.reason
    for script in ("train_fsdp", "train_flowers"):  # train_single/train_ddp: the rule's own lines, below
        module = import_script(script)
        assert getattr(module, "pick_device_and_backend", train_utils.pick_device_and_backend) is \
            train_utils.pick_device_and_backend and getattr(module, "pick_device", train_utils.pick_device) is \
            train_utils.pick_device, f"{script} picks its device by the rule's own lines"


def _inline_device_lines(script: str) -> str:
    """The core script's own device lines: train_single.py's one line, train_ddp.py's DDP step 2 block."""
    import textwrap

    source = (SCRIPTS / script).read_text()
    if script == "train_single.py":
        return next(line for line in source.splitlines() if line.strip().startswith("device = ")).strip()
    block = source.split("    accelerator = torch.accelerator.current_accelerator", 1)[1]
    block = "    accelerator = torch.accelerator.current_accelerator" + block.split("    torch.manual_seed", 1)[0]
    return textwrap.dedent(block)


@pytest.mark.parametrize("report", REPORTS, ids=str)
def test_the_core_scripts_inline_device_lines_follow_the_rule(report, fake_torch, monkeypatch):
    """train_single.py and train_ddp.py choose device and backend inline (plain torch): for each faked machine
    their lines give what course.hardware.choose gives, and name no device type or backend themselves."""
    fake_torch(report)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    chosen = choose(1, ranks=False, report=report)
    scope = {"torch": torch}
    exec(_inline_device_lines("train_single.py"), scope)  # noqa: S102 - the script's own lines, read from it
    assert scope["device"].type == chosen.device_type, chosen.reason
    lines = _inline_device_lines("train_ddp.py")
    assert "cuda" not in lines and "nccl" not in lines
    for nproc in (1, 2):
        chosen = choose(nproc, report=report)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(nproc))
        for local_rank in range(nproc):
            scope = {"torch": torch, "dist": dist, "os": os, "local_rank": local_rank}
            exec(lines, scope)  # noqa: S102
            expected = torch.device("cpu") if chosen.device_type == "cpu" else torch.device(chosen.device_type, local_rank)
            assert (scope["device"], scope["backend"]) == (expected, chosen.backend), (report, nproc, chosen.reason)
