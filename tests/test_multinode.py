"""Notebook 06. Its headless run (tests/test_notebooks.py) launches each of its jobs once and its cells assert
the results: who is who under static and c10d rendezvous, 2 nodes x 1 process = 1 node x 2, the SLURM template on
stand-ins, crash + restart = uninterrupted (weights, losses, TensorBoard curve), the restart store race (a failure
with the shared store is the stale address), writers killed mid-write, bad checkpoints refused and a refused resume
overwriting nothing, a node joining a running job, the missing rank named by monitored_barrier, the flight recorder
naming the mismatched collective, rendezvous failures naming the address. Here, read from that run: what its cells
print of those. Launched here, only what it does not run: train_resumable.py's warning when restarts share the
store; and the notebook's files and helpers."""

import os
import re
import subprocess

import nbformat
import pytest
import torch
from conftest import executed_notebook

from course import ROOT, SCRIPTS, WEIGHTS, flight_recorder, import_script
from course.checkpoint import load_checkpoint
from course.launcher import run_commands, torchrun_command
from course.models import build_model

NOTEBOOK = ROOT / "notebooks" / "06_multinode_and_faults.ipynb"
SLURM = ROOT / "tests" / "fixtures" / "slurm"
QUIET = {"on_line": lambda _: None}
TAGS = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
MNIST = ["--log-every", "5"]


def quiet(jobs, timeout=240, stop=None):
    return run_commands(jobs, timeout=timeout, stop=stop, **QUIET)


def c10d(port, n=2, run_id="t", extra=()):
    return [f"--nnodes={n}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", *extra]


def outputs(tmp_path, name):
    return ["--run-dir", str(tmp_path / "runs" / name), "--checkpoint", str(tmp_path / f"{name}.pt")]


# ------------------------------------------------------------------------------------ the notebook's files

def test_notebook_writes_the_slurm_template():
    """tests/test_notebooks.py checks scripts/*.py; this checks scripts/slurm/ (written by notebook 06)."""
    written = {}
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.cell_type == "code" and cell.source.startswith("%%writefile ../scripts/slurm/"):
            first, _, body = cell.source.partition("\n")
            written[first.split("../scripts/", 1)[1].strip()] = body if body.endswith("\n") else body + "\n"
    on_disk = {str(p.relative_to(SCRIPTS)) for p in (SCRIPTS / "slurm").iterdir()}
    assert set(written) == on_disk == {"slurm/train_ddp.sbatch"}
    for name, text in written.items():
        assert (SCRIPTS / name).read_text() == text, f"scripts/{name} differs from what notebook 06 writes"
    assert text.startswith("#!/bin/bash\n# Written by notebooks/06_multinode_and_faults.ipynb")


def test_resumable_differs_from_train_ddp_by_marked_steps_only():
    from course.scriptdiff import script_diff

    diff = script_diff("train_ddp.py", "train_resumable.py", marker=r"resume step (\d)")
    assert diff.steps == {1, 2, 3, 4, 5} and diff.unmarked == [], diff.text()
    script = (SCRIPTS / "train_resumable.py").read_text()  # plain, like train_ddp.py: no course module
    assert "from course" not in script and "import course" not in script
    assert "weights_only=True" in script and "map_location=device" in script


def test_max_restarts_defaults_to_zero():
    from torch.distributed.run import get_args_parser

    assert get_args_parser().get_default("max_restarts") == 0


# ------------------------------------------------------------------------------------ nodes and rendezvous

IDENTITY = re.compile(r"\[(\w+) (\w)\] \[rank\d+\]:RANK=(\d+) LOCAL_RANK=(\d+) GROUP_RANK=(\d+) WORLD_SIZE=(\d+)"
                      r".*agent_pid=(\d+)")


def test_rendezvous_failures_end_within_their_timeout_naming_the_address(notebook_06):
    """An endpoint nobody answers, a host name that does not exist, a node that never comes: the notebook's cell
    asserts that each job fails naming the address (or the rendezvous timeout) and that no process starts."""
    out = notebook_06.output()
    lines = {name: re.search(rf"^{name} +exit code (-?\d+): error: (.*)$", out, re.MULTILINE)
             for name in ("unreachable", "unknown host", "alone")}
    assert all(lines.values()), out[-3000:]
    assert all(int(m[1]) != 0 for m in lines.values())
    assert "192.0.2.1:29400" in lines["unreachable"][2] and "no-such-host.invalid" in lines["unknown host"][2]
    assert "not every node joined within 10 s" in lines["alone"][2], "RendezvousTimeoutError, said in one line"
    assert int(re.search(r"all three ended after (\d+) s", out)[1]) < 150


# ------------------------------------------------------------------------------------ SLURM, with stand-ins

def test_scontrol_stand_in_expands_host_lists():
    out = subprocess.run([str(SLURM / "scontrol"), "show", "hostnames", "gpu[01-03,07],login5,127.0.0.[1-2]"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["gpu01", "gpu02", "gpu03", "gpu07", "login5", "127.0.0.1", "127.0.0.2"]
    refused = subprocess.run([str(SLURM / "srun"), "--ntasks-per-node=2", "true"], capture_output=True, text=True,
                             env={**os.environ, "SLURM_JOB_NODELIST": "127.0.0.1"}, check=False)
    assert refused.returncode != 0, "the srun stand-in refuses what it does not simulate"


# ------------------------------------------------------------------------------------ restarts

def test_a_fresh_store_makes_restarts_work_and_a_shared_store_failure_is_explained(notebook_06):
    """Rank 1 crashes in attempt 0; in attempt 1 rank 0 joins 3 s late. With torchrun's shared store rank 1 can
    read attempt 0's address and fail to connect -- a race that the new rank 0 can also win, so either outcome is
    accepted there, but a failure must be that one (the notebook's cell asserts it). With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restart works."""
    out = notebook_06.output()
    codes = dict(re.findall(r"^(shared store|fresh store)(?: \(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\))?: exit code "
                            r"(-?\d+), the restarted attempt (?:worked|failed)$", out, re.MULTILINE))
    assert set(codes) == {"shared store", "fresh store"} and codes["fresh store"] == "0", out[-3000:]
    assert re.search(r"\[shared store\] \[rank1\]:.*RuntimeError: injected crash: rank 1 in attempt 0", out)
    shared_worked = "[shared store] [rank0]:attempt 1: all 2 ranks passed the barrier" in out
    assert (codes["shared store"] == "0") == shared_worked
    assert shared_worked or re.search(r"\[shared store\] \[rank1\]:.*Gloo connectFullMesh failed", out)
    assert "[fresh store] [rank0]:attempt 1: all 2 ranks passed the barrier" in out


def test_train_resumable_warns_when_restarts_share_the_store(datasets, tmp_path):
    """Launches: the notebook starts every restarting job with the fix, so it never shows this warning."""
    warned = quiet([("warned", torchrun_command("train_resumable.py", 1, [*MNIST, "--max-steps", "2",
                                                                          *outputs(tmp_path, "w")],
                                                ["--max-restarts=1"]), TAGS)])
    assert warned.returncode == 0, warned.output[-3000:]
    assert "[warned] [rank0]:warning: a restarted gloo group may read the dead workers' addresses" in warned.output


# ------------------------------------------------------------------------------------ checkpoints under faults

def test_a_writer_killed_mid_write(notebook_06):
    """Read from notebook 06's run: both writers killed by SIGKILL once 16 MiB were written; the atomic one
    leaves the old checkpoint, the plain one a file that does not load."""
    out = notebook_06.output()
    said = dict(re.findall(r"^(plain|atomic) +writer killed \(SIGKILL\) after \d+ MiB: the checkpoint (.*)$", out, re.MULTILINE))
    assert set(said) == {"plain", "atomic"}, out[-3000:]
    assert said["atomic"].startswith("loads: version 1;"), "the old checkpoint survives"
    assert said["plain"].startswith("does not load ("), "a truncated file"


@pytest.fixture(scope="module")
def resumable():
    return import_script("train_resumable")


@pytest.fixture(scope="module")
def notebook_06():
    """Notebook 06's headless run (shared with tests/test_notebooks.py)."""
    return executed_notebook("06_multinode_and_faults").require_ok()


@pytest.fixture(scope="module")
def good_checkpoint(notebook_06):
    """A real train_resumable.py checkpoint: the restarted run's (2 ranks, MLP on MNIST), written by the notebook."""
    return notebook_06.written(WEIGHTS / "06_multinode_and_faults" / "restarted.pt")


def test_malicious_pickle_is_refused_naming_the_file(tmp_path, resumable):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "sampler_skip": 0, "x": Payload()}, evil)
    with pytest.raises(ValueError, match=r"evil\.pt would run code \(\w+\.system\).*refused"):
        resumable.load_resume_state(evil, build_model("mlp", 10), torch.device("cpu"))
    assert not (tmp_path / "pwned").exists(), "the payload must never run"


def test_bad_checkpoints_give_one_clear_error(datasets, tmp_path, resumable, good_checkpoint):
    data = good_checkpoint.read_bytes()
    cases = {"truncated.pt": (data[: len(data) // 2], "mlp", r"truncated\.pt is corrupt or truncated"),
             "garbage.pt": (b"not a checkpoint", "mlp", r"garbage\.pt is corrupt or truncated"),
             "empty.pt": (b"", "mlp", r"empty\.pt is corrupt or truncated"),
             "good.pt": (data, "cnn", r"good\.pt was saved from a different model .*0\.0\.weight: absent in the file")}
    for name, (content, model, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            resumable.load_resume_state(path, build_model(model, 10, in_channels=1), torch.device("cpu"))
    weights_only = tmp_path / "weights_only.pt"
    torch.save({"model": load_checkpoint(good_checkpoint)["model"]}, weights_only)
    with pytest.raises(ValueError, match="not a train_resumable.py checkpoint"):
        resumable.load_resume_state(weights_only, build_model("mlp", 10), torch.device("cpu"))


def test_resuming_from_a_corrupt_checkpoint_overwrites_nothing(notebook_06):
    """Read from notebook 06's run: every rank stops before the process group with the same one line (the
    launcher shows it once), exit status 2, and the checkpoint and the previous results are unchanged."""
    out = notebook_06.output()
    truncated = WEIGHTS / "06_multinode_and_faults" / "truncated.pt"
    assert f"train_resumable.py: error: argument --checkpoint: {truncated} is corrupt or truncated" in out, out[-3000:]
    assert re.search(r"; torchrun's exit code 1 after \d+ s; files unchanged: True$", out, re.MULTILINE)


# ------------------------------------------------------------------------------------ the flight recorder

def _entry(seq, op, sizes=((1024,),)):
    return {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "profiling_name": op, "is_p2p": False,
            "input_sizes": [list(s) for s in sizes], "input_dtypes": ["Float"], "state": "scheduled"}


def test_first_mismatch_finds_a_different_operation_a_missing_one_and_none():
    same = [_entry(1, "gloo:all_reduce"), _entry(2, "gloo:all_reduce")]
    assert flight_recorder.first_mismatch({0: {"entries": same}, 1: {"entries": same}}) is None
    other = {0: {"entries": same}, 1: {"entries": [same[0], _entry(2, "gloo:broadcast")]}}
    found = flight_recorder.first_mismatch(other)
    assert found["seq"] == 2 and found["by_rank"][1][0] == "gloo:broadcast"
    assert "rank 1 called gloo:broadcast" in flight_recorder.describe(found)
    missing = flight_recorder.first_mismatch({0: {"entries": same}, 1: {"entries": same[:1]}})
    assert missing["seq"] == 2 and missing["by_rank"][1] is None
    assert "rank 1 never called it" in flight_recorder.describe(missing)
    sizes = flight_recorder.first_mismatch({0: {"entries": same[:1]}, 1: {"entries": [_entry(1, "gloo:all_reduce",
                                                                                                ((512,),))]}})
    assert sizes["seq"] == 1

