"""Notebook 06: simulated nodes, the SLURM template run with stand-ins, crash + restart = uninterrupted,
atomic and safe checkpoints, the missing rank named, rendezvous failures bounded by their timeouts."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
import torch

from course import ROOT, SCRIPTS, flight_recorder, import_script
from course.checkpoint import load_checkpoint
from course.errors import CourseError
from course.inline_tensorboard import read_scalars
from course.launcher import LaunchError, free_port, launch, run_commands, torchrun_command
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


def test_static_rendezvous_uses_node_rank_and_c10d_ignores_it():
    """Node A starts first with --node-rank=1, B second with 0. static: A is node 1. c10d: A is node 0
    (agents sorted by host, then pid), and torchrun warns that --node-rank is ignored."""
    jobs = []
    for backend in ("c10d", "static"):
        port = free_port()
        for name, node_rank in (("A", 1), ("B", 0)):
            rdzv = (c10d(port, run_id="who") if backend == "c10d" else
                    ["--nnodes=2", "--master-addr=127.0.0.1", f"--master-port={port}"])
            jobs.append((f"{backend} {name}", torchrun_command("whoami.py", 1, [], [*rdzv, f"--node-rank={node_rank}"],
                                                                 standalone=False), TAGS))
    result = quiet(jobs)
    assert result.returncode == 0, result.output[-3000:]
    rows = IDENTITY.findall(result.output)
    assert len(rows) == 4, result.output[-3000:]
    group = {(backend, node): int(g) for backend, node, _, _, g, _, _ in rows}
    assert group[("static", "A")] == 1 and group[("static", "B")] == 0
    pids = {node: int(pid) for backend, node, *_, pid in rows if backend == "c10d"}
    assert [group[("c10d", n)] for n in sorted(pids, key=pids.get)] == [0, 1]
    assert all(int(rank) == int(g) + int(local) for _, _, rank, local, g, _, _ in rows)  # 1 process per node
    assert re.search(r"\[c10d A\] .*node_rank is only used for static rdzv_backend", result.output)


def test_two_nodes_train_like_one_node(datasets, tmp_path):
    args = [*MNIST, "--epochs", "1", "--max-steps", "12"]
    port = free_port()
    jobs = [(f"node {n}", torchrun_command("train_ddp.py", 1, args + outputs(tmp_path, "two"),
                                          c10d(port, run_id="train"), standalone=False), TAGS) for n in "AB"]
    jobs.append(("one", torchrun_command("train_ddp.py", 2, args + outputs(tmp_path, "one")), TAGS))
    result = quiet(jobs)
    assert result.returncode == 0, result.output[-3000:]
    m = {name: json.loads((tmp_path / "runs" / name / "metrics.json").read_text()) for name in ("two", "one")}
    assert m["two"]["world_size"] == m["one"]["world_size"] == 2
    assert m["two"]["train_loss_history"] == m["one"]["train_loss_history"]
    assert m["two"]["val_correct"] == m["one"]["val_correct"]
    a, b = (load_checkpoint(tmp_path / f"{name}.pt")["model"] for name in ("two", "one"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


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


def test_sbatch_template_runs_on_two_simulated_nodes(datasets, tmp_path):
    env = {**TAGS, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "RDZV_PORT": str(free_port()), "RDZV_JOIN_TIMEOUT": "60"}
    result = quiet([("", [str(SLURM / "sbatch"), "scripts/slurm/train_ddp.sbatch", "--max-steps", "6",
                          *outputs(tmp_path, "slurm")], env)])
    assert result.returncode == 0, result.output[-3000:]
    assert re.search(r"^job \d+: 2 nodes x 1 processes, rendezvous at 127\.0\.0\.1:", result.output, re.MULTILINE)
    started = re.findall(r"^(\d): rank (\d) \(local rank 0\) on cpu, attempt 0$", result.output, re.MULTILINE)
    assert sorted(t for t, _ in started) == ["0", "1"] and sorted(r for _, r in started) == ["0", "1"]
    metrics = json.loads((tmp_path / "runs" / "slurm" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 6


# ------------------------------------------------------------------------------------ crash, restart, resume

def test_crash_and_restart_end_like_an_uninterrupted_run(datasets, tmp_path):
    """Rank 1 crashes mid-epoch 1 (after step 26, checkpoints every 8 steps, epochs of 12 steps);
    --max-restarts=1 restarts; the resumed run ends with the same weights, losses and TensorBoard curve."""
    args = [*MNIST, "--batch-size", "2500", "--epochs", "3", "--save-every", "8", "--log-every", "2", "--resume"]

    def run(name, extra=(), torchrun_args=()):
        return launch("train_resumable.py", 2, [*args, *extra, "--checkpoint", tmp_path / f"{name}.pt"],
                      run_dir=tmp_path / name, torchrun_args=torchrun_args, env=FIX, timeout=300, **QUIET)

    plain = run("plain")
    crashed = run("crashed", ["--crash-at-step", "21"], ["--max-restarts=1"])
    assert "injected crash: rank 1 at step 21" in crashed.output
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in crashed.output, "no warning: the fix is on"
    assert re.search(r"rank 0 \(local rank 0\) on cpu, attempt 1", crashed.output)
    resumed = re.findall(r"rank (\d): resumed from crashed.pt onto cpu: epoch 1, step 16, skipping 20000 samples",
                         crashed.output)
    assert sorted(resumed) == ["0", "1"], crashed.output[-3000:]  # every rank loads; rank 0 alone wrote
    a, b = (load_checkpoint(tmp_path / f"{name}.pt") for name in ("plain", "crashed"))
    assert a["step"] == b["step"] == 36
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) <= 1e-6
    assert plain.metrics["train_loss_history"] == crashed.metrics["train_loss_history"]
    curves = {name: read_scalars(tmp_path / name)[name] for name in ("plain", "crashed")}
    assert curves["plain"] == curves["crashed"], "the TensorBoard curve continues: no gap, no repeated step"
    steps = [s for s, _ in curves["crashed"]["train/loss"]]
    assert steps == sorted(set(steps))


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


def test_a_node_joins_a_running_job(datasets, tmp_path):
    """--nnodes=1:2: node A trains alone, node B joins once A has a checkpoint; the 2-rank group resumes."""
    ckpt = tmp_path / "elastic.pt"
    flags = c10d(free_port(), n="1:2", run_id="el", extra=["--rdzv-conf=last_call_timeout=1,join_timeout=60"])
    args = [*MNIST, "--batch-size", "16", "--epochs", "3", "--save-every", "50", "--resume", "--checkpoint", ckpt,
            "--run-dir", tmp_path / "run"]
    node = torchrun_command("train_resumable.py", 1, args, flags, standalone=False)
    late = ["bash", "-c", 'while [ ! -e "$0" ]; do sleep 0.2; done; exec "$@"', str(ckpt), *node]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                if ckpt.exists() and load_checkpoint(ckpt)["world_size"] == 2:
                    stop.set()
            except (OSError, RuntimeError):  # replaced while we read it: read it again
                time.sleep(0.1)
            time.sleep(0.3)

    threading.Thread(target=watch, daemon=True).start()
    with pytest.raises(LaunchError, match="stopped") as stopped:
        quiet([("A", node, {**TAGS, **FIX}), ("B", late, {**TAGS, **FIX})], timeout=280, stop=stop)
    output = stopped.value.output
    assert re.search(r"\[B\] \[rank1\]:rank 1: resumed from elastic.pt .*saved by 1 ranks", output), output[-3000:]
    assert len(re.findall(r"\[A\] \[rank0\]:rank 0 \(local rank 0\) on cpu, attempt 0", output)) == 2, \
        output[-3000:]  # A's rank alone, then again in the 2-rank group: a membership change is no restart
    assert load_checkpoint(ckpt)["world_size"] == 2


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


# ------------------------------------------------------------------------------------ the missing rank

def test_monitored_barrier_names_the_missing_rank_in_seconds():
    start = time.monotonic()
    result = launch("whoami.py", 2, ["--absent-rank", "1", "--timeout", "4"], check=False, timeout=180, **QUIET)
    assert result.returncode != 0
    assert re.search(r"Ranks? 1 failed to pass monitoredBarrier in 4000 ms", result.output)
    assert time.monotonic() - start < 120


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


def test_flight_recorder_dumps_name_the_collective_that_did_not_match(tmp_path):
    """2 gloo ranks hang in all_reduce vs broadcast; after the 3 s timeout each rank's dump names its own call."""
    result = launch("fr_mismatch.py", 2, ["--timeout", "3"], backend="gloo", run_dir=tmp_path, timeout=120,
                    quiet=True, **QUIET)
    assert result.returncode == 0  # within the launcher's 120 s, or LaunchError
    dumps = flight_recorder.read_dumps(tmp_path / "flight_recorder")
    assert sorted(dumps) == [0, 1]
    found = flight_recorder.first_mismatch(dumps)
    assert found["seq"] == 3, flight_recorder.table(dumps)
    assert found["by_rank"][0][0] == "gloo:all_reduce" and found["by_rank"][1][0] == "gloo:broadcast"
    code, last = flight_recorder.analyzer(tmp_path / "flight_recorder")
    assert isinstance(code, int) and (code == 0 or last), "the analyzer's failure is reported by its last line"
