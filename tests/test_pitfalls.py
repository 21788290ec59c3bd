"""Notebooks 04 and 04b: each pitfall script's bug shows its symptom, each fix runs, within timeouts, and no
process is left behind; the notebooks' helpers (course.pitfall_jobs, course.spawn_capture) do what they say. Real torchrun jobs with gloo on the CPU (hangs are cut by a 5 s process-group timeout)."""

import contextlib
import re
import sys
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from course import ROOT, SCRIPTS
from course.checkpoint import load_checkpoint
from course.data import build_datasets
from course.launcher import free_port, launch, run_commands, torchrun_command
from course.measure import Comparison
from course.models import build_model
from course.pitfall_jobs import comparison_from, must_fail, symptom
from course.spawn_capture import output_of_children, spawn_bounded

HANG_S = 5  # process-group timeout for the runs that hang
QUIET = {"backend": "gloo", "quiet": True, "on_line": lambda _: None}  # CPU, even on a GPU box
CPU_ONLY = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def no_leftovers(wait_no_processes):
    """Yields a function that registers a script; after the test, none of its processes may remain."""
    watched = []
    yield lambda script: watched.append(str(SCRIPTS / script))  # full path: not another checkout's jobs
    for script in watched:
        assert wait_no_processes(script, timeout=10) == [], f"processes of {script} left behind"


def comparison(metrics) -> Comparison:
    return comparison_from(metrics["comparison"])


def test_device_check_and_tensors_left_on_another_device(no_leftovers):
    no_leftovers("pitfall_device.py")
    ok = launch("pitfall_device.py", nproc=2, timeout=120, **QUIET)
    assert sorted(re.findall(r"rank (\d) \(local rank \d, gloo\): parameters on ([^,\s]+)", ok.output)) == \
        [("0", "cpu"), ("1", "cpu")]
    assert len(re.findall(r"rank \d: 3 steps done", ok.output)) == 2
    for bug in ("loss-weight", "plain-attribute"):
        bad = launch("pitfall_device.py", nproc=2, args=["--bug", bug], check=False, timeout=120, **QUIET)
        assert bad.returncode != 0
        assert "Tensor on device meta is not on the expected device cpu!" in bad.output


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the refusal on a machine without a GPU")
def test_set_device_bug_refuses_to_run_without_a_gpu(no_leftovers):
    no_leftovers("pitfall_device.py")
    result = launch("pitfall_device.py", nproc=1, args=["--bug", "set-device"], check=False, timeout=120, **QUIET)
    assert result.returncode != 0 and "needs a GPU" in result.output


def test_without_set_epoch_the_order_repeats_but_the_model_learns(no_leftovers, tmp_path):
    no_leftovers("pitfall_set_epoch.py")
    result = launch("pitfall_set_epoch.py", nproc=2, args=["--compare", 1, "--epochs", 2, "--train-samples", 4000],
                    run_dir=tmp_path, timeout=300, **QUIET)
    for case, expected_orders in (("without", 1), ("with", 2)):
        for rank in (0, 1):
            orders = re.findall(rf"\[{case} set_epoch, seed 0\] rank {rank} epoch \d: first indices (\[.*?\])",
                                result.output)
            assert len(orders) == 2 and len(set(orders)) == expected_orders
    accuracies = comparison(result.metrics)
    assert accuracies.unit == "val accuracy"
    assert min(accuracies["without set_epoch"].values) > 0.5  # not the 10% of chance
    assert min(accuracies["with set_epoch"].values) > 0.5


def test_workers_comparison_runs_every_configuration_in_one_job(no_leftovers, tmp_path):
    no_leftovers("pitfall_workers.py")
    result = launch("pitfall_workers.py", nproc=2, args=["--configs", "0:1", "1:1", "--rounds", 2, "--steps", 2,
                                                          "--warmup", 1, "--batch-size", 8],
                    run_dir=tmp_path, timeout=300, **QUIET)
    speeds = comparison(result.metrics)
    assert list(speeds.measurements) == ["0 workers, 1 thread per rank", "1 worker, 1 thread per rank"]
    assert all(len(m.values) == 2 and min(m.values) > 0 for m in speeds.measurements.values())
    assert result.metrics["busy"] == {"0 workers, 1 thread per rank": 2, "1 worker, 1 thread per rank": 4}
    assert speeds.conclusion("1 worker, 1 thread per rank", "0 workers, 1 thread per rank") in \
        ("above", "below", "same", "unclear", "noisy")


def test_two_jobs_on_one_port_clash_and_standalone_does_not(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    same = ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    command = torchrun_command("pitfall_rendezvous.py", 1, torchrun_args=same, standalone=False)
    clash = run_commands([(job, command, CPU_ONLY) for job in "AB"], timeout=120, on_line=lambda _: None)
    assert sorted(code != 0 for code in clash.returncodes) == [False, True]
    assert "EADDRINUSE" in clash.output
    both = run_commands([(job, torchrun_command("pitfall_rendezvous.py", 1), CPU_ONLY) for job in "AB"],
                        timeout=120, on_line=lambda _: None)
    assert both.returncodes == [0, 0]


def test_a_worker_with_nobody_at_the_endpoint_times_out(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    node1 = torchrun_command("pitfall_rendezvous.py", 1, standalone=False, torchrun_args=[
        "--nnodes=2", "--node-rank=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        f"--rdzv-conf=timeout={HANG_S}"])
    result = run_commands([("node 1", node1, CPU_ONLY)], timeout=120, on_line=lambda _: None)
    assert result.returncode != 0
    assert f"The client socket has timed out after {HANG_S * 1000}ms" in result.output


def two_nodes(args):
    endpoint = f"127.0.0.1:{free_port()}"
    return run_commands([(f"node {n}", torchrun_command("pitfall_rendezvous.py", 1, args, standalone=False,
                                                        torchrun_args=["--nnodes=2", f"--node-rank={n}",
                                                                       "--rdzv-backend=c10d",
                                                                       f"--rdzv-endpoint={endpoint}"]), CPU_ONLY)
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


def test_torchrun_overrides_rank_world_size_and_master_addr_from_the_environment(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    result = launch("pitfall_rendezvous.py", nproc=1, timeout=120, **QUIET,
                    env={"RANK": "4", "WORLD_SIZE": "8", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29999"})
    seen = re.search(r"RANK=(\d+) LOCAL_RANK=0 WORLD_SIZE=(\d+) MASTER_ADDR=(\S+) MASTER_PORT=(\d+)", result.output)
    assert seen[1] == "0" and seen[2] == "1" and seen[3] != "192.0.2.1" and seen[4] != "29999"


def test_uneven_inputs_hang_until_the_timeout_and_both_fixes_finish(no_leftovers):
    no_leftovers("pitfall_uneven.py")
    hang = launch("pitfall_uneven.py", nproc=2, args=["--timeout", HANG_S], check=False, timeout=120, **QUIET)
    assert hang.returncode != 0
    assert "rank 0: 33 samples, 5 batches" in hang.output and "rank 1: 32 samples, 4 batches" in hang.output
    assert f"Timed out waiting {HANG_S * 1000}ms" in hang.output
    for fix in ("drop-last", "join"):
        done = launch("pitfall_uneven.py", nproc=2, args=["--fix", fix], timeout=120, **QUIET)
        assert len(re.findall(r"rank \d: done", done.output)) == 2
    # Join: the finished rank contributes zero gradients, and DDP divides by the initial world size (2).
    assert "rank 0 step 5: the others have joined; DDP applied 0.50 x this batch's own gradient" in done.output


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


def test_learning_rate_runs_compare_three_configurations_at_equal_samples(no_leftovers, tmp_path):
    no_leftovers("pitfall_lr.py")
    result = launch("pitfall_lr.py", nproc=2, args=["--samples", 1280, "--rounds", 1], run_dir=tmp_path,
                    timeout=300, **QUIET)
    accuracies = comparison(result.metrics)
    small, kept, scaled = result.metrics["names"]
    assert (small, kept, scaled) == ("global batch 64, lr 0.01", "global batch 128, lr 0.01 (kept)",
                                     "global batch 128, lr 0.02 (scaled x2)")
    assert result.metrics["steps"] == {small: 20, kept: 10, scaled: 10}  # equal samples: 1280
    assert all(0 < m.values[0] <= 1 for m in accuracies.measurements.values())


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


def exercise_passes(result, checkpoint) -> bool:
    """Notebook 04's check: the reported accuracy is the saved model's accuracy on the whole validation set."""
    _, val_set, num_classes = build_datasets("mnist")
    model = build_model("mlp", num_classes)
    model.load_state_dict(load_checkpoint(checkpoint)["model"])
    model.eval()
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in DataLoader(val_set, 1000))
    return result.metrics["val_total"] == len(val_set) and result.metrics["val_correct"] == correct


def test_check_yourself_exercise_fails_as_committed_and_passes_once_fixed(no_leftovers, tmp_path):
    no_leftovers("pitfall_exercise.py")
    buggy = SCRIPTS / "pitfall_exercise.py"
    fixed = tmp_path / "pitfall_exercise_fixed.py"
    counts_line = "    correct, total = counts.tolist()\n"
    assert buggy.read_text().count(counts_line) == 1
    fixed.write_text(buggy.read_text().replace(counts_line, "    dist.all_reduce(counts)\n" + counts_line))
    for script, passes in ((buggy, False), (fixed, True)):
        checkpoint = tmp_path / f"{script.stem}.pt"
        result = launch(script, nproc=2, args=["--checkpoint", checkpoint], run_dir=tmp_path / script.stem,
                        timeout=300, **QUIET)
        assert exercise_passes(result, checkpoint) is passes, script.name


def test_symptom_keeps_each_line_once_and_drops_the_copies_torchrun_repeats(capsys):
    output = "[rank0]: boom here\n[rank1]: boom here\nboom here\n[rank0]: boom here\nnothing\n" + "x boom\n" * 12
    found = symptom(output, "boom", limit=3)
    assert found[:2] == ["[rank0]: boom here", "[rank1]: boom here"]  # the untagged repeat and the duplicate: gone
    assert "boom here" not in found and len(found) == 3  # "x boom" once
    printed = capsys.readouterr().out
    assert printed.startswith("SYMPTOM:") and "nothing" not in printed


def test_must_fail_refuses_a_job_that_succeeds(no_leftovers):
    no_leftovers("pitfall_rendezvous.py")
    with pytest.raises(AssertionError, match="was expected to fail"):
        must_fail("pitfall_rendezvous.py", nproc=1, backend="gloo")


def _print_rank(rank):
    print(f"child {rank} says hello", flush=True)


def _sleep_forever(rank):
    time.sleep(600)


def test_spawn_capture_catches_the_childrens_output_and_ends_them_in_time():
    with output_of_children() as children:
        codes = spawn_bounded(_print_rank, nprocs=2, timeout=60)
    assert codes == [0, 0]
    assert children[0].count("says hello") == 2
    started = time.monotonic()
    with pytest.raises(TimeoutError), output_of_children():
        spawn_bounded(_sleep_forever, nprocs=1, timeout=3)
    assert time.monotonic() - started < 60
    assert spawned_children() == []


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("pitfall_*.py")))
def test_each_pitfall_script_names_the_notebook_that_writes_it(script):
    first = (SCRIPTS / script).read_text().splitlines()[0]
    notebook = re.search(r"notebooks/(\S+\.ipynb)", first)[1]
    assert f"%%writefile ../scripts/{script}" in (ROOT / "notebooks" / notebook).read_text().replace("\\n", "\n")
