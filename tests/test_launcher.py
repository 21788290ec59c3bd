"""The notebook launcher: live tagged output, failures raise with the real traceback, timeouts and
interrupts leave no process behind, the plan follows the hardware."""

import json
import sys
import time

import pytest
from conftest import processes_running, wait_for_no_processes
from jupyter_client.manager import start_new_kernel

from course import ROOT
from course.hardware import cpu_cores
from course.launcher import LaunchError, launch, plan, root_cause

FIXTURE = "tests/fixtures/ranks.py"


def test_streams_every_rank_live():
    seen = []
    result = launch(FIXTURE, nproc=2, env={"PAUSE": "3"}, timeout=120,
                    on_line=lambda line: seen.append((time.monotonic(), line)))
    text = "".join(line for _, line in seen)
    assert result.returncode == 0
    for rank in (0, 1):
        assert f"[rank{rank}]:rank {rank} of 2" in text
        assert f"[rank{rank}]:rank {rank} sum 3" in text
    # Live, not at the end: the line before the pause arrived well before the one after it.
    before = next(t for t, line in seen if "before pause" in line)
    after = next(t for t, line in seen if "after pause" in line)
    assert after - before > 2


def test_failure_raises_with_the_failing_ranks_traceback():
    with pytest.raises(LaunchError) as error:
        launch(FIXTURE, nproc=2, env={"FAIL_RANK": "1"}, timeout=120, quiet=True, on_line=lambda _: None)
    message = str(error.value)
    assert "exit code 1" in message
    assert "rank      : 1" in message
    assert "ValueError: deliberate failure on rank 1" in message


def test_failure_without_check_returns_the_exit_code():
    result = launch(FIXTURE, nproc=2, env={"FAIL_RANK": "0"}, timeout=120, check=False, on_line=lambda _: None)
    assert result.returncode == 1
    assert "deliberate failure on rank 0" in root_cause(result.output)


def test_timeout_ends_every_process():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 15 s"):
        launch(FIXTURE, nproc=2, env={"HANG": "1"}, timeout=15, on_line=lambda _: None)
    assert time.monotonic() - start < 30
    assert wait_for_no_processes("fixtures/ranks.py", timeout=5) == []


def test_interrupting_a_notebook_cell_leaves_no_orphans():
    """A real Jupyter kernel, interrupted the way JupyterLab's stop button does it."""
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(ROOT / "notebooks"))
    try:
        msg_id = client.execute(f"from course.launcher import launch\n"
                                f"launch({FIXTURE!r}, nproc=2, env={{'HANG': '1'}}, timeout=300)")
        deadline, output = time.monotonic() + 90, ""
        while "[rank1]:rank 1 sum" not in output or "[rank0]:rank 0 sum" not in output:
            assert time.monotonic() < deadline, f"ranks did not start: {output}"
            msg = client.get_iopub_msg(timeout=90)
            if msg["msg_type"] == "stream":
                output += msg["content"]["text"]
        assert len(processes_running("fixtures/ranks.py")) >= 3  # torchrun + 2 ranks
        manager.interrupt_kernel()
        reply = client.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = client.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert wait_for_no_processes("fixtures/ranks.py", timeout=10) == []
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_returns_metrics_of_the_run(tmp_path):
    result = launch("hello_distributed.py", nproc=2, run_dir=tmp_path / "hello", args=["--max-mib", 1],
                    timeout=120, on_line=lambda _: None)
    assert result.metrics["all_reduce_sum"] == result.metrics["expected_sum"] == 3
    assert result.metrics["world_size"] == 2 and result.metrics["backend"] == "gloo"
    assert json.loads((tmp_path / "hello" / "metrics.json").read_text()) == result.metrics
    assert list((tmp_path / "hello").glob("events.out.tfevents.*"))


def test_plan_follows_the_hardware():
    chosen = plan(2)
    assert (chosen.backend, chosen.device) == ("gloo", "cpu")  # no GPU on this machine
    assert chosen.threads_per_rank == max(1, cpu_cores() // 2)
    assert plan(1).threads_per_rank == cpu_cores()
    with pytest.raises(ValueError, match="nccl needs one GPU per process"):
        plan(2, "nccl")
    with pytest.raises(ValueError):
        plan(0)


def test_missing_script_is_reported():
    with pytest.raises(FileNotFoundError, match="no_such_script.py"):
        launch("no_such_script.py", nproc=1)


def test_overhead_over_bare_torchrun_is_small():
    """The launcher adds a reader thread and a poll loop; it must not add seconds to a run."""
    import subprocess

    from course.launcher import torchrun_command

    cmd = torchrun_command(FIXTURE, 2)
    env = {**__import__("os").environ, "OMP_NUM_THREADS": str(plan(2).threads_per_rank)}
    bare, ours = [], []
    for _ in range(2):  # interleaved, so that machine noise hits both alike
        start = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, check=True, timeout=120)
        bare.append(time.monotonic() - start)
        ours.append(launch(FIXTURE, nproc=2, timeout=120, on_line=lambda _: None).wall_time)
    print(f"bare torchrun {min(bare):.2f} s, launcher {min(ours):.2f} s", file=sys.stderr)
    assert min(ours) < min(bare) * 1.25 + 0.5  # generous: 2 shared vCPUs vary +-30 % run to run


def test_one_torchrun_command_builder():
    from course.launcher import torchrun_command

    single = torchrun_command("hello_distributed.py", 2, ["--max-mib", 1])
    assert single[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--tee=3",
                          "--role=rank", str(ROOT / "scripts" / "hello_distributed.py"), "--max-mib", "1"]
    node = ["--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400"]
    explicit = torchrun_command("hello_distributed.py", 1, [], node, standalone=False)
    assert "--standalone" not in explicit and explicit[explicit.index("--role=rank") + 1:][:4] == node
    with pytest.raises(ValueError, match="standalone=False"):
        torchrun_command("hello_distributed.py", 1, [], ["--master-port=29500"])
