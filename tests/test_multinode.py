"""Notebook 06. Its headless run (tests/test_notebooks.py) launches each of its jobs once and its cells assert
the results: who is who under static and c10d rendezvous, 2 nodes x 1 process = 1 node x 2, the SLURM template on
stand-ins, crash + restart = uninterrupted (weights, losses, TensorBoard curve), a node joining a running job, the
missing rank named by monitored_barrier, the flight recorder naming the mismatched collective. Here, with runs of
their own: the restart store race in detail, rendezvous failures bounded by their timeouts, atomic and safe
checkpoints under faults, and the notebook's files and helpers."""

import hashlib
import os
import re
import signal
import subprocess
import sys
import time

import nbformat
import pytest
import torch

from course import ROOT, SCRIPTS, flight_recorder, import_script
from course.checkpoint import load_checkpoint
from course.errors import CourseError
from course.launcher import free_port, launch, run_commands, torchrun_command
from course.models import build_model

NOTEBOOK = ROOT / "notebooks" / "06_multinode_and_faults.ipynb"
SLURM = ROOT / "tests" / "fixtures" / "slurm"
QUIET = {"on_line": lambda _: None}
TAGS = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
FIX = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh rendezvous store per round (notebook 06, section 3)
MNIST = ["--dataset", "mnist", "--log-every", "5"]


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


def test_max_restarts_defaults_to_zero():
    from torch.distributed.run import get_args_parser

    assert get_args_parser().get_default("max_restarts") == 0


# ------------------------------------------------------------------------------------ nodes and rendezvous

IDENTITY = re.compile(r"\[(\w+) (\w)\] \[rank\d+\]:RANK=(\d+) LOCAL_RANK=(\d+) GROUP_RANK=(\d+) WORLD_SIZE=(\d+)"
                      r".*agent_pid=(\d+)")


def test_rendezvous_failures_end_within_their_timeout_naming_the_address():
    """An endpoint nobody answers, a host name that does not exist, a node that never comes."""
    lonely = f"127.0.0.1:{free_port()}"
    cases = [("unreachable", "192.0.2.1:29400"), ("unknown", "no-such-host.invalid:29400"), ("alone", lonely)]
    start = time.monotonic()
    result = quiet([(name, torchrun_command("whoami.py", 1, [], [
        "--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=bad",
        "--rdzv-conf=read_timeout=5,join_timeout=10"], standalone=False), TAGS) for name, endpoint in cases],
        timeout=150)
    assert time.monotonic() - start < 150
    assert all(code != 0 for code in result.returncodes)
    text = {name: "\n".join(line for line in result.output.splitlines() if line.startswith(f"[{name}]"))
            for name, _ in cases}
    assert "while trying to connect to (192.0.2.1, 29400)" in text["unreachable"] or "192.0.2.1" in text["unreachable"]
    assert "no-such-host.invalid" in text["unknown"]
    assert "RendezvousTimeoutError" in text["alone"]
    assert "RANK=" not in result.output, "no process may start"


# ------------------------------------------------------------------------------------ SLURM, with stand-ins

def test_scontrol_stand_in_expands_host_lists():
    out = subprocess.run([str(SLURM / "scontrol"), "show", "hostnames", "gpu[01-03,07],login5,127.0.0.[1-2]"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["gpu01", "gpu02", "gpu03", "gpu07", "login5", "127.0.0.1", "127.0.0.2"]
    refused = subprocess.run([str(SLURM / "srun"), "--ntasks-per-node=2", "true"], capture_output=True, text=True,
                             env={**os.environ, "SLURM_JOB_NODELIST": "127.0.0.1"}, check=False)
    assert refused.returncode != 0, "the srun stand-in refuses what it does not simulate"


# ------------------------------------------------------------------------------------ restarts

def test_a_fresh_store_makes_restarts_work_and_a_shared_store_failure_is_explained(datasets, tmp_path):
    """Rank 1 crashes in attempt 0; in attempt 1 rank 0 joins 3 s late. With torchrun's shared store rank 1
    can read attempt 0's address and fail to connect (refused, or a timeout on a busy machine) -- a race that
    the new rank 0 can also win, so either outcome is accepted there, but a failure must be that one. With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restart works. train_resumable.py warns when restarts are on
    without the fix."""
    late = ["--crash-rank", "1", "--timeout", "10", "--rank0-late", "3"]
    jobs = [("shared", torchrun_command("whoami.py", 2, late, ["--max-restarts=1"]), TAGS),
            ("fresh", torchrun_command("whoami.py", 2, late, ["--max-restarts=1"]), {**TAGS, **FIX}),
            ("warned", torchrun_command("train_resumable.py", 2, [*MNIST, "--max-steps", "2", *outputs(tmp_path, "w")],
                                        ["--max-restarts=1"]), TAGS)]
    result = quiet(jobs)
    shared, fresh, warned = result.returncodes
    assert "[shared] [rank1]:" in result.output and "injected crash: rank 1 in attempt 0" in result.output
    shared_worked = "[shared] [rank0]:attempt 1: all 2 ranks passed the barrier" in result.output
    assert (shared == 0) == shared_worked
    assert shared_worked or re.search(r"\[shared\] \[rank1\]:.*Gloo connectFullMesh failed", result.output), \
        result.output[-3000:]
    assert fresh == 0 and "[fresh] [rank0]:attempt 1: all 2 ranks passed the barrier" in result.output
    assert warned == 0 and "[warned] [rank0]:warning: a restarted gloo group may read the dead workers' addresses" \
        in result.output


# ------------------------------------------------------------------------------------ checkpoints under faults

WRITER = """import sys, torch
sys.path.insert(0, sys.argv[3])
from course.checkpoint import save_checkpoint
state = {"version": 2, "w": torch.ones(64, 1024, 1024)}
save_checkpoint(state, sys.argv[2]) if sys.argv[1] == "atomic" else torch.save(state, sys.argv[2])
"""


@pytest.mark.parametrize("how", ["atomic", "plain"])
def test_a_writer_killed_mid_write(tmp_path, how):
    path = tmp_path / "ckpt.pt"
    torch.save({"version": 1}, path)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, how, str(path), str(SCRIPTS)])

    def written():
        files = [path] if how == "plain" else list(tmp_path.glob(".ckpt.pt.*.tmp"))
        return sum(f.stat().st_size for f in files if f.exists())

    deadline = time.monotonic() + 120
    while writer.poll() is None and written() < 16 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.002)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL, "the writer finished before it could be killed"
    if how == "atomic":
        assert load_checkpoint(path) == {"version": 1}, "the old checkpoint survives"
    else:
        with pytest.raises(Exception):  # noqa: B017 - whatever torch.load raises for a truncated file
            load_checkpoint(path)


@pytest.fixture(scope="module")
def resumable():
    return import_script("train_resumable")


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A real train_resumable.py checkpoint (1 rank, 2 steps)."""
    folder = tmp_path_factory.mktemp("good")
    launch("train_resumable.py", 1, [*MNIST, "--max-steps", "2", *outputs(folder, "good")], timeout=240, **QUIET)
    return folder / "good.pt"


def test_malicious_pickle_is_refused_naming_the_file(tmp_path, resumable):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "sampler_skip": 0, "x": Payload()}, evil)
    with pytest.raises(CourseError, match=r"evil\.pt .*would run code .*system.*refused"):
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
        with pytest.raises(CourseError, match=message):
            resumable.load_resume_state(path, build_model(model, 10, in_channels=1), torch.device("cpu"))
    weights_only = tmp_path / "weights_only.pt"
    torch.save({"model": load_checkpoint(good_checkpoint)["model"]}, weights_only)
    with pytest.raises(CourseError, match="not a train_resumable.py checkpoint"):
        resumable.load_resume_state(weights_only, build_model("mlp", 10), torch.device("cpu"))


def test_resuming_from_a_corrupt_checkpoint_overwrites_nothing(datasets, tmp_path, good_checkpoint):
    run_dir = good_checkpoint.parent / "runs" / "good"  # the results of the run that wrote the good checkpoint
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(good_checkpoint.read_bytes()[:5000])
    kept = [corrupt, run_dir / "metrics.json", *run_dir.glob("events.out.tfevents.*")]
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in kept}
    result = launch("train_resumable.py", 2, [*MNIST, "--resume", "--checkpoint", corrupt], run_dir=run_dir,
                    check=False, timeout=240, **QUIET)
    errors = [line for line in result.output.splitlines() if "error:" in line]
    # every rank stops before the process group with the same one line (the launcher shows it once)
    assert 1 <= len(errors) <= 2 and len({re.sub(r"^\[rank\d+\]:", "", line) for line in errors}) == 1, errors
    assert all(f"checkpoint {corrupt} is corrupt or truncated" in line for line in errors)
    assert re.search(r"exitcode\s*: 2\b", result.output)
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in kept} == before, "nothing overwritten"


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

