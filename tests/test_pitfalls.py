"""Notebook 04's pitfall scripts: each bug shows its symptom, each fix runs, within timeouts, and no
process is left behind. Real torchrun jobs with gloo on the CPU (hangs are cut by a 5 s process-group timeout)."""

import contextlib
import re
import sys
import time

import psutil
import pytest
from conftest import wait_for_no_processes

from course import ROOT, SCRIPTS
from course.launcher import free_port, launch, run_commands

HANG_S = 5  # process-group timeout for the runs that hang
QUIET = {"backend": "gloo", "quiet": True, "on_line": lambda _: None}  # CPU, even on a GPU box
CPU_ONLY = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def torchrun(*options, script, args=()):
    return [sys.executable, "-m", "torch.distributed.run", *options, "--tee=3", "--role=rank",
            str(SCRIPTS / script), *map(str, args)]


@pytest.fixture
def no_leftovers():
    """Yields a function that registers a script; after the test, none of its processes may remain."""
    watched = []
    yield lambda script: watched.append(str(SCRIPTS / script))  # full path: not another checkout's jobs
    for script in watched:
        assert wait_for_no_processes(script, timeout=10) == [], f"processes of {script} left behind"


def test_device_check_and_tensors_left_on_another_device(no_leftovers):
    no_leftovers("pitfall_device.py")
    ok = launch("pitfall_device.py", nproc=2, timeout=120, **QUIET)
    assert sorted(re.findall(r"rank (\d) \(local rank \d\): parameters on ([^,\s]+)", ok.output)) == \
        [("0", "cpu"), ("1", "cpu")]
    assert len(re.findall(r"rank \d: 3 steps done", ok.output)) == 2
    for bug in ("loss-weight", "plain-attribute"):
        bad = launch("pitfall_device.py", nproc=2, args=["--bug", bug], check=False, timeout=120, **QUIET)
        assert bad.returncode != 0
        assert "Tensor on device meta is not on the expected device cpu!" in bad.output


def test_set_device_bug_refuses_to_run_without_gpus(no_leftovers):
    no_leftovers("pitfall_device.py")
    result = launch("pitfall_device.py", nproc=1, args=["--bug", "set-device"], check=False, timeout=120, **QUIET)
    assert result.returncode != 0 and "needs 2 or more GPUs" in result.output


def test_without_set_epoch_the_order_repeats_but_the_model_learns(no_leftovers, tmp_path):
    no_leftovers("pitfall_set_epoch.py")
    runs = {}
    for name, extra in (("bug", ["--bug"]), ("fixed", [])):
        runs[name] = launch("pitfall_set_epoch.py", nproc=2, args=["--epochs", 2, *extra], run_dir=tmp_path / name,
                            timeout=300, **QUIET)
    for name, expected_orders in (("bug", 1), ("fixed", 2)):
        for rank in (0, 1):
            orders = re.findall(rf"rank {rank} epoch \d: first indices (\[.*?\])", runs[name].output)
            assert len(orders) == 2 and len(set(orders)) == expected_orders
        assert runs[name].metrics["val_accuracy"] > 0.5  # the source claims 10% without set_epoch


def test_two_jobs_on_one_port_clash_and_standalone_does_not(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    port = free_port()
    same = ["--nnodes=1", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    clash = run_commands([(job, torchrun(*same, script="pitfall_rendezvous.py"), CPU_ONLY) for job in "AB"],
                         timeout=120, on_line=lambda _: None)
    assert sorted(code != 0 for code in clash.returncodes) == [False, True]
    assert "EADDRINUSE" in clash.output
    both = run_commands([(job, torchrun("--standalone", "--nproc-per-node=1", script="pitfall_rendezvous.py"),
                          CPU_ONLY) for job in "AB"], timeout=120, on_line=lambda _: None)
    assert both.returncodes == [0, 0]


def test_a_worker_with_nobody_at_the_endpoint_times_out(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    node1 = torchrun("--nnodes=2", "--node-rank=1", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                     f"--master-port={free_port()}", f"--rdzv-conf=timeout={HANG_S}", script="pitfall_rendezvous.py")
    result = run_commands([("node 1", node1, CPU_ONLY)], timeout=120, on_line=lambda _: None)
    assert result.returncode != 0
    assert f"The client socket has timed out after {HANG_S * 1000}ms" in result.output


def two_nodes(args):
    endpoint = f"127.0.0.1:{free_port()}"
    return run_commands([(f"node {n}", torchrun("--nnodes=2", f"--node-rank={n}", "--nproc-per-node=1",
                                                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                                                script="pitfall_rendezvous.py", args=args), CPU_ONLY)
                         for n in (0, 1)], timeout=120, on_line=lambda _: None)


def test_local_rank_as_global_rank_on_two_nodes(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    buggy = two_nodes(["--bug", "--timeout", HANG_S])
    assert buggy.returncodes[0] != 0 and buggy.returncodes[1] != 0
    assert len(re.findall("joining as rank 0", buggy.output)) == 2
    assert "DistStoreError: wait timeout" in buggy.output
    fixed = two_nodes([])
    assert fixed.returncodes == [0, 0]
    assert fixed.output.count("all_reduce of the ranks = 1 (expected 1)") == 2


def test_torchrun_overrides_rank_and_world_size_from_the_environment(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    result = launch("pitfall_rendezvous.py", nproc=1, env={"RANK": "4", "WORLD_SIZE": "8"}, timeout=120, **QUIET)
    assert "RANK=0 LOCAL_RANK=0 WORLD_SIZE=1" in result.output


def test_uneven_inputs_hang_until_the_timeout_and_both_fixes_finish(no_leftovers):
    no_leftovers("pitfall_uneven.py")
    hang = launch("pitfall_uneven.py", nproc=2, args=["--timeout", HANG_S], check=False, timeout=120, **QUIET)
    assert hang.returncode != 0
    assert "rank 0: 33 samples, 5 batches" in hang.output and "rank 1: 32 samples, 4 batches" in hang.output
    assert f"Timed out waiting {HANG_S * 1000}ms" in hang.output
    for fix in ("drop-last", "join"):
        done = launch("pitfall_uneven.py", nproc=2, args=["--fix", fix], timeout=120, **QUIET)
        assert len(re.findall(r"rank \d: done", done.output)) == 2


def test_every_rank_logging_and_saving_vs_rank_0(no_leftovers, tmp_path):
    no_leftovers("pitfall_rank0.py")
    from course.inline_tensorboard import read_scalars

    for name, extra in (("every_rank", ["--bug"]), ("rank0_only", [])):
        launch_args = ["--steps", 5, "--checkpoint", tmp_path / f"{name}.pt", *extra]
        result = launch("pitfall_rank0.py", nproc=2, args=launch_args, run_dir=tmp_path / name, timeout=120, **QUIET)
        events = list((tmp_path / name).glob("events.out.tfevents.*"))
        points = read_scalars(tmp_path / name)[name]["train/loss"]
        if extra:
            assert len(events) == 2 and len(points) == 10
            assert result.output.count(": wrote ") == 2
            assert len(re.findall(r'load_state_dict failed: .*Unexpected key\(s\) in state_dict: "module\.',
                                  result.output)) == 2
        else:
            assert len(events) == 1 and len(points) == 5
            assert result.output.count(": wrote ") == 1
            assert result.output.count("weights equal to the trained model: True") == 2


def spawned_children() -> list[psutil.Process]:
    """Processes started by multiprocessing's spawn from this checkout (their command line names no script)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(proc.info["cmdline"] or []) and proc.info["cwd"] == str(ROOT):
                found.append(proc)
    return found


def test_mp_spawn_of_a_function_without_a_module_fails_and_from_a_file_works(no_leftovers):
    no_leftovers("pitfall_spawn.py")
    in_main = ("import torch.multiprocessing as mp\n"
               "def worker(rank):\n    print('worker', rank)\n"
               "mp.spawn(worker, nprocs=2)\n")  # like a notebook: __main__ has no file to re-import
    bad = run_commands([("", [sys.executable, "-c", in_main], CPU_ONLY)], timeout=120, on_line=lambda _: None)
    assert bad.returncode != 0
    assert "Can't get attribute 'worker' on <module '__main__'" in bad.output
    good = run_commands([("", [sys.executable, str(SCRIPTS / "pitfall_spawn.py")], CPU_ONLY)], timeout=120,
                        on_line=lambda _: None)
    assert good.returncode == 0 and good.output.count("all_reduce sum 3") == 2
    deadline = time.monotonic() + 10
    while spawned_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert spawned_children() == []


def test_a_collective_on_one_rank_hangs_detail_names_it_and_the_fix_runs(no_leftovers):
    no_leftovers("pitfall_collective.py")
    hang = launch("pitfall_collective.py", nproc=2, args=["--bug", "--timeout", HANG_S], check=False, timeout=120,
                  **QUIET)
    assert hang.returncode != 0 and f"Timed out waiting {HANG_S * 1000}ms" in hang.output
    detail = launch("pitfall_collective.py", nproc=2, args=["--bug", "--timeout", 60], check=False, timeout=120,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, **QUIET)
    assert detail.returncode != 0 and "Detected mismatch between collectives" in detail.output
    assert "ALLREDUCE" in detail.output and "BARRIER" in detail.output
    fixed = launch("pitfall_collective.py", nproc=2, timeout=120, **QUIET)
    assert len(re.findall(r"rank \d: done", fixed.output)) == 2


def test_grad_scalers_are_not_synchronised_by_ddp(no_leftovers):
    no_leftovers("pitfall_grad_scaler.py")
    result = launch("pitfall_grad_scaler.py", nproc=2, timeout=120, **QUIET)
    gaps = dict(re.findall(r"restored on (every rank|rank 0 only): largest weight difference between ranks (\S+)",
                           result.output))
    assert float(gaps["every rank"]) == 0 and float(gaps["rank 0 only"]) > 0
    final = {case: dict(re.findall(rf"\[{case}\] rank (\d) step 2: scale (\d+)", result.output))
             for case in ("every rank", "rank 0 only")}
    assert final["every rank"] == {"0": "512", "1": "512"}  # rank 1's overflow halves rank 0's scale too
    assert final["rank 0 only"] == {"0": "512", "1": "32768"}  # never synchronised by DDP
