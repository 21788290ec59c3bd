"""The notebook launcher: live tagged output, failures raise with the real traceback, timeouts and
interrupts leave no process behind, the plan follows the hardware."""

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest
from jupyter_client.manager import start_new_kernel

from course import ROOT
from course.hardware import cpu_cores
from course.launcher import LaunchError, launch, plan

FIXTURE = "tests/fixtures/ranks.py"
# Its processes, found by the absolute path: another checkout's tests on the same machine run their own copy.
RANKS = str((ROOT / FIXTURE).resolve())


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
    assert "rank 1 exited with code 1" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert len(message.splitlines()) < 12  # one clear message; the full report is on the error
    assert "Root Cause" in error.value.output and error.value.failure in message


def test_failure_without_check_returns_the_exit_code():
    result = launch(FIXTURE, nproc=2, env={"FAIL_RANK": "0"}, timeout=120, check=False, on_line=lambda _: None)
    assert result.returncode == 1
    assert "rank 0 exited with code 1" in result.failure and "deliberate failure on rank 0" in result.failure


def test_timeout_ends_every_process_and_keeps_torchruns_traceback_out_of_the_stream(wait_no_processes):
    """Issue 21 #9 too: torchrun's SignalException traceback (told to stop) is in the output, not streamed;
    issue 35 #5: so is torch 2.14's shutdown line, "Received 15 death signal, shutting down workers"."""
    start, shown = time.monotonic(), []
    with pytest.raises(LaunchError, match="timed out after 15 s") as error:
        launch(FIXTURE, nproc=2, env={"HANG": "1"}, timeout=15, on_line=shown.append)
    assert time.monotonic() - start < 30
    assert wait_no_processes(RANKS, timeout=5) == []
    stream = "".join(shown)
    assert "SignalException" not in stream and "Traceback" not in stream, stream
    assert "SignalException" in error.value.output
    assert "death signal" not in stream and "death signal, shutting down workers" in error.value.output, stream
    assert shown[-1].startswith("[launcher] timed out after 15 s")


def test_interrupting_a_notebook_cell_leaves_no_orphans(find_processes, wait_no_processes):
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
        assert len(find_processes(RANKS)) >= 3  # torchrun + 2 ranks
        manager.interrupt_kernel()
        reply = client.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = client.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert wait_no_processes(RANKS, timeout=10) == []
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
    from course.hardware import accelerator_count

    if accelerator_count():
        pytest.skip("this machine has an accelerator; tests/test_hardware.py fakes every case")
    chosen = plan(2)
    assert (chosen.backend, chosen.device) == ("gloo", "cpu")  # no GPU on this machine
    assert chosen.refusal is None and "no accelerator found" in chosen.reason
    assert chosen.threads_per_rank == max(1, cpu_cores() // 2)
    assert plan(1).threads_per_rank == cpu_cores()
    with pytest.raises(ValueError, match="nccl needs one GPU per process"):
        plan(2, "nccl")
    with pytest.raises(ValueError):
        plan(0)


def test_missing_script_is_reported():
    with pytest.raises(FileNotFoundError, match="no_such_script.py"):
        launch("no_such_script.py", nproc=1)


def test_the_launcher_overhead_benchmark_writes_its_rounds_and_verdict(tmp_path, capsys):
    """The speed goal (the launcher adds no seconds) is measured by a benchmark, not asserted here."""
    from course.bench_launcher import main as bench

    metrics = bench(["--repeats", "1", "--warmup", "0", "--run-dir", str(tmp_path)])  # one round: what is written
    assert metrics == json.loads((tmp_path / "metrics.json").read_text())
    values = metrics["values"]
    assert len(values["bare torchrun"]) == len(values["course launcher"]) == 1
    ratios = [ours / bare for ours, bare in zip(values["course launcher"], values["bare torchrun"])]
    assert metrics["verdict"].startswith(f"course launcher: {statistics.median(ratios):.2f}x")
    assert "1 round: too few to decide" in metrics["verdict"], "one round never decides"
    assert metrics["verdict"] in capsys.readouterr().out


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


# ---------------------------------------------------------------------------- failures explained (issue 9 #3/#4)

FAILS = "tests/fixtures/fails.py"


def launch_failing(args, nproc=2):
    shown = []
    with pytest.raises(LaunchError) as error:
        launch(FAILS, nproc=nproc, args=args, timeout=120, on_line=shown.append)
    return error.value, "".join(shown)


def test_foreign_script_without_record_names_the_raising_rank():
    error, shown = launch_failing(["--mode", "raise"])
    message = str(error)
    assert "rank 1 exited with code 1" in message, message
    assert "RuntimeError: foreign failure on rank 1" in message and "fails.py" in message
    assert "Connection closed by peer" not in message  # rank 0 only lost its peer
    # torchrun's own report stays out of the live output, and in the error's full output
    assert "ChildFailedError" not in shown and "Root Cause" not in shown
    assert "ChildFailedError" in error.output and "Root Cause" in error.output
    assert error.failure == error.result.failure and error.failure in message


def test_error_reported_once_names_the_rank_that_said_it():
    """The course's scripts: rank 0 prints `error: ...`, every rank exits 2 (course.errors.reported_once)."""
    error, _ = launch_failing(["--mode", "course"])
    message = str(error)
    assert re.search(r"rank 0 (exited with code 2|\(stopped by torchrun after rank 1 exited with code 2\))", message), \
        message
    assert "error: no dataset in /nowhere/flowers" in error.failure
    assert error.output.count("error: no dataset") == 1


def test_argparse_error_is_the_message():
    result = launch(FAILS, nproc=2, args=["--epochs", "x"], timeout=120, check=False, on_line=lambda _: None)
    assert result.returncode != 0  # torchrun itself exits 1 when a rank fails
    assert re.search(r"rank \d exited with code 2", result.failure)
    assert "error: argument --epochs: invalid int value: 'x'" in result.failure


def test_failure_text_from_a_report_without_error_files():
    """Which rank is named, decided from torchrun's report and the tagged lines alone (no processes)."""
    from course.launcher import describe_failure

    report = ("[rank0]:rank 0 started\n[rank0]:[rank0]: Traceback (most recent call last):\n"
              "[rank0]:[rank0]:   File \"x.py\", line 3, in <module>\n[rank0]:[rank0]:     dist.barrier()\n"
              "[rank0]:[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:1\n"
              "[rank1]:[rank1]: Traceback (most recent call last):\n"
              "[rank1]:[rank1]:   File \"x.py\", line 5, in <module>\n[rank1]:[rank1]:     boom()\n"
              "[rank1]:[rank1]: KeyError: 'boom'\n"
              "Failures:\n[1]:\n  time      : t\n  host      : h\n  rank      : 1 (local_rank: 1)\n"
              "  exitcode  : 1 (pid: 2) \n  error_file: <N/A>\n  traceback : To enable traceback see: x\n"
              "------------------------------------------------------------\n"
              "Root Cause (first observed failure):\n[0]:\n  time      : t\n  host      : h\n"
              "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 3) \n  error_file: <N/A>\n"
              "  traceback : To enable traceback see: x\n" + "=" * 60 + "\n")
    text = describe_failure(report, 1)
    assert text.startswith("rank 1 exited with code 1") and "KeyError: 'boom'" in text, text
    assert describe_failure("python: can't open file 'x.py'\n", 2).startswith("exit code 2")


def test_abort_at_exit_is_named_as_gloos_exit_race():
    """A rank that aborts after its last line (faulthandler: no Python frame), as torch 2.14's gloo worker
    threads sometimes make it: the failure says so and points to the barrier, from the job's own lines."""
    from course.launcher import describe_failure

    def report(rank_lines):
        return ("[rank0]:done\n" + "".join(f"[rank1]:{line}\n" for line in rank_lines)
                + "Root Cause (first observed failure):\n[0]:\n  time      : t\n  host      : h\n"
                "  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 3)  (SIGABRT)\n  error_file: <N/A>\n"
                "  traceback : Signal 6 (SIGABRT) received by PID 3\n" + "=" * 60 + "\n")

    at_exit = ["terminate called without an active exception", "Fatal Python error: Aborted", "",
               "Thread 0x00007fa3dd2adb80 (most recent call first):", "  <no Python frame>"]
    text = describe_failure(report(at_exit), 1)
    assert text.startswith("rank 1 was ended by SIGABRT") and "while Python was exiting" in text, text
    in_code = at_exit[:4] + ['  File "x.py", line 9 in main']  # the same abort with Python code running
    assert "while Python was exiting" not in describe_failure(report(in_code), 1)


def test_show_report_outside_ipython(capsys):
    from course.launcher import RunResult, show_report

    show_report(RunResult(returncode=1, wall_time=1.0, output="line one\nline two\n", failure="rank 0 exited"))
    printed = capsys.readouterr().out
    assert "full output (2 lines); failed: rank 0 exited" in printed and "line two" in printed


# ---------------------------------------------------------------------------- refusals, working directory

def test_more_cpu_ranks_than_cores_is_refused_by_launch():
    from course.launcher import LaunchRefused

    if plan(cpu_cores() + 1).device != "cpu":
        pytest.skip("enough accelerators here: the ranks would not run on the CPU")
    with pytest.raises(LaunchRefused, match=f"{cpu_cores()} CPU cores"):
        launch(FIXTURE, nproc=cpu_cores() + 1, timeout=60)
    assert plan(cpu_cores() + 1, allow_oversubscribe=True).refusal is None
    assert plan(min(2, cpu_cores())).refusal is None  # 2 ranks on 2 cores: allowed


def test_cwd_is_where_a_foreign_script_writes(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text((ROOT / FAILS).read_text())
    result = launch("mine.py", nproc=1, args=["--mode", "write"], cwd=tmp_path, timeout=120,
                    on_line=lambda _: None)
    assert f"cwd {tmp_path}" in result.output
    assert (tmp_path / "snapshot.txt").read_text() == "written by rank 0\n"
    assert not (ROOT / "snapshot.txt").exists()


# ---------------------------------------------------------------------------- the caller dies (issue 9 #1)

CALLER = ("import sys\nfrom course.launcher import launch\n"
          "launch(sys.argv[1], nproc=2, args=['--max-steps', '600', '--step-seconds', '0.1'], timeout=300)\n")


@pytest.mark.parametrize("how,psutil_there", [(signal.SIGTERM, True), (signal.SIGKILL, True), (signal.SIGKILL, False)],
                         ids=["SIGTERM", "SIGKILL", "SIGKILL-without-psutil"])
def test_killing_the_caller_ends_the_whole_job(how, psutil_there, wait_until, tmp_path):
    """Without psutil (the doctor taken home), the caller and its watchdog read the process table themselves."""
    import subprocess
    import threading

    import psutil

    slow = str(ROOT / "tests" / "fixtures" / "slow_ranks.py")
    env = dict(os.environ)
    if not psutil_there:
        (tmp_path / "psutil.py").write_text("raise ImportError('psutil is not installed here')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    caller = subprocess.Popen([sys.executable, "-c", CALLER, slow], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    seen, job = [], []
    threading.Thread(target=lambda: seen.extend(caller.stdout), daemon=True).start()
    try:
        wait_until(lambda: sum("starting" in line for line in list(seen)) >= 2, 120, "both ranks to start")
        job += psutil.Process(caller.pid).children(recursive=True)  # torchrun, 2 ranks, the watchdog
        assert sum(slow in " ".join(p.cmdline()) for p in job) >= 3
        caller.send_signal(how)
        caller.wait(10)
        died = time.monotonic()

        def gone(proc):
            try:
                return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_until(lambda: all(gone(p) for p in job), 5, "every process of the job to end")
        print(f"{how.name}: job gone {time.monotonic() - died:.1f} s after the caller died", file=sys.stderr)
    finally:
        caller.kill()
        for proc in job:  # whatever a failed test left behind
            try:
                proc.kill()
            except psutil.Error:
                pass


def test_the_process_table_without_psutil_agrees_with_psutil():
    """ddp_doctor.runner.procinfo (used where psutil is not installed) sees the same tree, creation times and
    zombies as psutil, and never signals a process that has ended."""
    import psutil

    from ddp_doctor.runner import procinfo

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    tree = subprocess.Popen([sys.executable, "-c", code + "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(tree.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        me, theirs = procinfo.Process(), psutil.Process()
        assert abs(me.create_time() - theirs.create_time()) < 0.05
        ours = sorted(p.pid for p in me.children(recursive=True))
        assert ours == sorted(p.pid for p in theirs.children(recursive=True)) and len(ours) >= 2, ours
        child = procinfo.Process(tree.pid)
        assert child.is_running() and child.status() != procinfo.STATUS_ZOMBIE
        grandchild = child.children()[0]
        grandchild.kill()
        time.sleep(0.5)
        assert procinfo.Process(grandchild.pid).status() == procinfo.STATUS_ZOMBIE  # its parent has not reaped it
        child.terminate()
        tree.wait(10)
        assert not child.is_running()
        with pytest.raises(procinfo.NoSuchProcess):
            child.kill()
    finally:
        tree.kill()
        tree.wait()


KILLED_WHILE_WRITING = """
import json, os, signal, sys
import torch.distributed.elastic.multiprocessing.errors.error_handler as eh
from {module} import record

def dump_then_die(data, fp, **kw):  # torchrun's SIGTERM arriving in the middle of the write
    fp.write("{{")
    fp.flush()
    os.kill(os.getpid(), signal.SIGKILL)

eh.json.dump = dump_then_die

@record
def main():
    raise RuntimeError("peer gone")

main()
"""


@pytest.mark.parametrize("module, leaves_partial_file", [("torch.distributed.elastic.multiprocessing.errors", True),
                                                         ("course.errors", False)])
def test_a_rank_killed_while_writing_its_error_file_leaves_none(tmp_path, module, leaves_partial_file):
    """torch's @record writes the error file in place: killed mid-write, it leaves a file torchrun cannot
    parse (torchrun then dies with a JSONDecodeError instead of restarting). course.errors.record leaves none."""
    error_file = tmp_path / "error.json"
    script = tmp_path / "rank.py"
    script.write_text(KILLED_WHILE_WRITING.format(module=module))
    done = subprocess.run([sys.executable, str(script)], check=False, env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert done.returncode == -signal.SIGKILL
    assert error_file.exists() == leaves_partial_file
    if leaves_partial_file:
        with pytest.raises(json.JSONDecodeError):
            json.loads(error_file.read_text())


def test_course_record_writes_torchruns_error_file(tmp_path):
    """What torchrun reads back: the same JSON torch's @record writes."""
    error_file = tmp_path / "error.json"
    script = tmp_path / "rank.py"
    script.write_text("from course.errors import record\n@record\ndef main():\n    raise RuntimeError('peer gone')\nmain()\n")
    done = subprocess.run([sys.executable, str(script)], check=False, env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)},
                          capture_output=True, text=True)
    assert done.returncode == 1 and "peer gone" in done.stderr
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "RuntimeError: peer gone" and "py_callstack" in message["extraInfo"]
    assert not list(tmp_path.glob("*.partial"))


def test_a_stopped_job_keeps_what_its_processes_wrote_as_they_ended():
    """torchrun copies its ranks' log files to its stdout when it is told to stop; those lines explain
    the end of the job, so the launcher reads the pipes to the end after ending the processes."""
    from course.launcher import run_commands

    script = ("import signal, sys, time\n"
              "def bye(*_):\n"
              "    time.sleep(0.5)  # the launcher has long stopped reading by now\n"
              "    print('last words', flush=True)\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "print('started', flush=True)\n"
              "time.sleep(60)\n")
    stop = threading.Event()
    shown = []

    def on_line(line):
        shown.append(line)
        if "started" in line:
            stop.set()

    with pytest.raises(LaunchError, match="stopped") as stopped:
        run_commands([("job", [sys.executable, "-c", script], {})], timeout=30, stop=stop, on_line=on_line)
    assert "[job] last words\n" in stopped.value.output
    assert shown[-2:] == ["[job] last words\n", "[launcher] stopped: ended 1 process(es)\n"]


def test_lines_torchrun_glued_to_an_unfinished_progress_bar_are_cut_apart():
    """Seen in CI: rank 0's tqdm bar (stderr, no newline yet) with its next stdout line, or torchrun's log,
    on one line -- which hid the line from a regex anchored at the tag, and from the failure report."""
    from course.launcher import unglue

    bar = "[rank0]:epoch 0:  30%|███       | 1122/3750 [00:03<00:07, 373.48it/s]"
    assert unglue(f"{bar}[rank0]:rank 0 (local rank 0) on cpu, attempt 0\n") == \
        [f"{bar}\n", "[rank0]:rank 0 (local rank 0) on cpu, attempt 0\n"]
    log = "W1130 07:23:20.212000 30471 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 30494"
    assert unglue(f"{bar}{log}\n") == [f"{bar}\n", f"{log}\n"]
    for whole in ("[rank1]:[rank1]: Traceback (most recent call last):\n", "[rank0]:a list [rank1]: as text\n",
                  "[rank0]:\n"):
        assert unglue(whole) == [whole]


# ---------------------------------------------------------------------------- failures named (issue 21)

KILLED_RANK = """
import os, signal
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
dist.barrier()
"""


def test_a_rank_killed_by_a_signal_is_named_first(tmp_path):
    """Issue 21 #2: rank 0 SIGKILLed; rank 1 then only sees 'Connection closed by peer'."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RANK)
    result = launch(script, 2, timeout=120, check=False, on_line=lambda _: None)
    assert result.returncode != 0
    first = result.failure.splitlines()[0]
    assert first.startswith("rank 0 was ended by SIGKILL"), result.failure
    if "by peer" in result.output:  # rank 1 noticed ("Connection closed/reset by peer") before torchrun stopped it
        assert "having only seen rank 0 die: rank 1" in result.failure.splitlines()[-1], result.failure


def test_the_same_argument_error_from_every_rank_is_shown_once():
    """Issue 21 #3: argparse's usage and error, printed by both ranks, appear once in the stream."""
    shown = []
    with pytest.raises(LaunchError) as error:
        launch("train_ddp.py", 2, ["--epochs", "0"], timeout=120, on_line=shown.append)
    stream = "".join(shown)
    assert stream.count("error: argument --epochs") == 1, stream
    assert stream.count("usage: train_ddp.py") == 1
    assert "printed the same" in stream
    assert error.value.output.count("error: argument --epochs") == 2  # all of it is kept in the output
    assert [line for line in str(error.value).splitlines() if "error:" in line] == \
        ["  train_ddp.py: error: argument --epochs: '0' is not a whole number in [1, 2**63)"]


def test_different_lines_from_each_rank_are_all_shown():
    stream_lines = []
    with pytest.raises(LaunchError):
        launch(FAILS, nproc=2, args=["--epochs", "x"], timeout=120, on_line=stream_lines.append)
    stream = "".join(stream_lines)
    assert stream.count("error: argument --epochs: invalid int value: 'x'") == 1
    from ddp_doctor.runner.stream import TorchrunStream

    feed = TorchrunStream()
    lines = ["[rank0]:Traceback (most recent call last):\n", "[rank1]:Traceback (most recent call last):\n",
             "[rank0]:ValueError: zero\n", "[rank1]:ValueError: one\n"]
    shown = [line for text in lines for line, how in feed.feed(text) if how != "keep"]
    shown += [line for line, how in feed.flush() if how != "keep"]
    assert sorted(shown) == sorted(lines)  # rank 1 said something else: nothing of it is hidden


LAB_LIKE = ("import sys\nfrom course.launcher import launch\nprint('launching', flush=True)\n"
            "launch(sys.argv[1], nproc=2, args=['--max-steps', '600', '--step-seconds', '0.1'], timeout=300)\n")


def test_ending_the_callers_whole_tree_removes_the_log_folder(tmp_path, wait_until):
    """Issue 21 #10: stopping Lab ends the kernel and the watchdog at once (kill_tree): no folder is left."""
    from course.launcher import kill_tree

    slow = str(ROOT / "tests" / "fixtures" / "slow_ranks.py")
    caller = subprocess.Popen([sys.executable, "-c", LAB_LIKE, slow], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    seen = []
    threading.Thread(target=lambda: seen.extend(caller.stdout), daemon=True).start()
    try:
        wait_until(lambda: sum("starting" in line for line in list(seen)) >= 2, 120, "both ranks to start")
        assert list(tmp_path.glob("course-torchrun-*"))
        kill_tree(caller.pid)
        wait_until(lambda: not list(tmp_path.glob("course-torchrun-*")), 10, "the log folder to be removed")
    finally:
        kill_tree(caller.pid, grace=1)


STUBBORN = """
import signal, time
import torch.distributed as dist
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # slow to stop, as a rank of a loaded machine can be
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()}: starting", flush=True)
time.sleep(300)
"""
# make lab's process tree: the helper (python -m course.lab) starts Lab in its own session with a watchdog
# over it; a kernel of Lab launches the job.
LAB_HELPER = ("import subprocess, sys\nfrom course.launcher import start_watchdog\n"
              "kernel = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True)\n"
              "start_watchdog([kernel.pid])\nkernel.wait()\n")


def test_killing_make_lab_during_a_launch_leaves_no_log_folder(tmp_path, wait_until, find_processes):
    """Issue 35 #4: SIGKILL of the Lab helper. Its watchdog ends the tree, and kills the job's own watchdog
    before that one has removed the log folder (ranks slow to stop); the Lab's watchdog removes it then."""
    from course.launcher import kill_tree

    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    temp = tmp_path / "tmp"
    temp.mkdir()
    helper = subprocess.Popen([sys.executable, "-c", LAB_HELPER, LAB_LIKE, str(script)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "TMPDIR": str(temp)})
    seen = []
    threading.Thread(target=lambda: seen.extend(helper.stdout), daemon=True).start()
    try:
        wait_until(lambda: sum("starting" in line for line in list(seen)) >= 2, 120, "both ranks to start")
        assert list(temp.glob("course-torchrun-*"))
        helper.kill()
        wait_until(lambda: not find_processes(str(script)), 20, "every process of the job to end")
        wait_until(lambda: not list(temp.glob("course-torchrun-*")), 10, "the log folder to be removed")
    finally:
        helper.kill()
        for proc in find_processes(str(script)):
            kill_tree(proc.pid, grace=0)


def test_a_launch_removes_log_folders_whose_owner_is_gone(tmp_path, monkeypatch):
    """Issue 35 #4, the other half: a folder left by an owner killed outright is removed by the next launch;
    the folder of a live owner is kept."""
    import tempfile

    import psutil

    from ddp_doctor.runner.processes import LOG_PREFIX

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    born = psutil.Process(gone.pid).create_time()
    gone.wait()
    me = psutil.Process()
    orphan = tmp_path / f"{LOG_PREFIX}{gone.pid}-{round(born)}-abc"
    live = tmp_path / f"{LOG_PREFIX}{me.pid}-{round(me.create_time())}-abc"
    for folder in (orphan, live):
        (folder / "attempt_0").mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    launch(FIXTURE, nproc=1, timeout=120, on_line=lambda _: None)
    assert not orphan.exists() and live.is_dir()
    assert sorted(tmp_path.glob(f"{LOG_PREFIX}*")) == [live]  # and the launch's own folder is gone


RESTARTED = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.barrier()
if attempt == 0 and dist.get_rank() == 1:
    raise SystemExit("failing once on purpose")
dist.barrier()
print(f"rank {dist.get_rank()} finished attempt {attempt}", flush=True)
dist.destroy_process_group()
"""


def test_restarts_through_the_launcher_get_a_fresh_store(tmp_path):
    """Issue 21 #13: with --max-restarts, gloo's restarted attempt needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    shown = []
    result = launch(script, 2, torchrun_args=["--max-restarts=1"], timeout=180, on_line=shown.append)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shown[0]
    assert "rank 0 finished attempt 1" in result.output and "rank 1 finished attempt 1" in result.output


HUNG = """
import sys, time, traceback
from datetime import timedelta
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=4))
rank = dist.get_rank()
try:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never calls it: rank 0 is stuck first
    else:
        time.sleep(2)
        dist.barrier()  # and rank 1 waits here, 2 s later, for a barrier rank 0 never reaches
except RuntimeError:
    traceback.print_exc()
    sys.stderr.flush()
    if rank == 0:
        time.sleep(30)  # slow to exit (a loaded machine): rank 1, which timed out later, exits first
    raise
"""


def test_a_hang_names_the_rank_that_timed_out_first_not_the_first_to_exit(tmp_path):
    """Issue 35 #6: both ranks time out, rank 0 first; rank 1 exits first and torchrun stops rank 0.
    The failure names rank 0, from the timeout messages, not 'stopped by torchrun after rank 1 exited'."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    result = launch(script, 2, timeout=120, check=False, on_line=lambda _: None)
    assert "exitcode  : -15" in result.output, result.output  # torchrun stopped rank 0 after rank 1 exited
    first = result.failure.splitlines()[0]
    assert first.startswith("rank 0 timed out first (torchrun then ended it by SIGTERM)"), result.failure
    assert "all_reduce" in result.failure and "Timed out waiting 4000ms" in result.failure


def test_the_launchers_jobs_start_with_the_exit_race_wait(monkeypatch, tmp_path):
    """Gloo's exit race: every job run_commands starts imports ddp_doctor/runner/startup/sitecustomize.py, whose
    exit handler waits (while torch.distributed is loaded) until no other thread of the process is runnable."""
    import atexit
    import importlib.util

    from course.launcher import run_commands
    from ddp_doctor.runner.run import STARTUP

    result = run_commands([("", [sys.executable, "-c", "import sitecustomize; print(sitecustomize.__file__)"], {})],
                          timeout=60, on_line=lambda line: None)
    assert result.returncode == 0 and str(STARTUP / "sitecustomize.py") in result.output, result.output
    (tmp_path / "sitecustomize.py").write_text("print('the environment own sitecustomize ran')\n")
    result = run_commands([("", [sys.executable, "-c", "pass"], {"PYTHONPATH": str(tmp_path)})],
                          timeout=60, on_line=lambda line: None)
    assert "the environment own sitecustomize ran" in result.output, result.output  # not shadowed
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    spec = importlib.util.spec_from_file_location("course_startup", STARTUP / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert registered == [module._let_threads_finish]
    if sys.platform == "linux":
        stop = threading.Event()
        spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
        spinner.start()
        try:  # a spinning thread counts as runnable at least sometimes
            assert any(module._runnable_threads() > 0 for _ in range(2000))
        finally:
            stop.set()
            spinner.join()


STUCK = ROOT / "tests" / "fixtures" / "stuck_ranks.py"


def _line_of(code: str) -> str:
    """'stuck_ranks.py:N `code`' of the fixture's line that holds ``code``."""
    lines = STUCK.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if code in line)
    return f"stuck_ranks.py:{number} `{lines[number - 1].strip()}`"


@pytest.fixture(scope="module")
def stuck_jobs(tmp_path_factory):
    """Issue 51 #2: four stuck jobs at once (they sleep; one start-up's worth of time): two stopped by the launcher's
    timeout, one ended by its own 3 s process-group timeout, one the exercise checker's (under the recorder) stopped
    by its timeout. {name: the LaunchError, the RunResult, or the checker's Run}."""
    from course.exercises import running

    jobs = {"loader": (["loader"], 30, True), "collective": (["collective"], 30, True),
            "pg-timeout": (["collective", "3"], 120, False)}
    found = {}

    def run(name, args, timeout, check):
        try:
            found[name] = launch(STUCK, 2, args, timeout=timeout, check=check, on_line=lambda _: None)
        except LaunchError as error:
            found[name] = error

    def checker(fork):  # the exercise checker's launch: under the recorder
        found[f"checker-{fork}"] = running.launch(STUCK, ["collective"], tmp_path_factory.mktemp("checker"), "gloo",
                                                  30, fork=fork)

    threads = [threading.Thread(target=run, args=(name, *job)) for name, job in jobs.items()]
    threads += [threading.Thread(target=checker, args=(fork,)) for fork in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return found


def test_a_timeout_names_where_each_rank_was_a_dataloader_and_a_sleep(stuck_jobs, wait_no_processes):
    """Each rank's Python stack, dumped by faulthandler on SIGUSR2 before the job is stopped: rank 0 waits for a
    DataLoader worker that sleeps forever in __getitem__, rank 1 sleeps."""
    error = stuck_jobs["loader"]
    assert isinstance(error, LaunchError) and "timed out after 30 s" in str(error), error
    message = str(error)
    assert f"rank 0 at {_line_of('for batch in DataLoader')} (inside its DataLoader" in message, message
    assert f"rank 1 at {_line_of('time.sleep(3600)  # rank 1')}, in no collective" in message, message
    assert "never reached the collective" not in message  # nobody waits in one
    assert error.places and error.places in error.failure
    assert wait_no_processes(str(STUCK), timeout=10) == []


def test_a_timeout_names_the_rank_that_never_reached_the_collective(stuck_jobs):
    error = stuck_jobs["collective"]
    message = str(error)
    assert isinstance(error, LaunchError) and "timed out after 30 s" in message, error
    assert f"rank 0 in all_reduce at {_line_of('dist.all_reduce')}" in message, message
    sleep = _line_of("time.sleep(3600)  # rank 1")
    assert f"the rank that never reached the collective: rank 1, at {sleep} (rank 0 waited in all_reduce)" in message


def test_a_process_group_timeout_says_where_the_other_rank_was(stuck_jobs):
    """Rank 0's own wait times out (3 s): before its traceback, and before torchrun ends rank 1, it asks rank 1
    where it is; the failure names rank 0's timeout and rank 1's line."""
    result = stuck_jobs["pg-timeout"]
    assert not isinstance(result, LaunchError) and result.returncode != 0, result
    assert result.failure.startswith("rank 0"), result.failure
    assert "when rank 0's wait timed out (RuntimeError: Timed out waiting 3000ms" in result.failure, result.failure
    sleep = _line_of("time.sleep(3600)  # rank 1")
    assert f"rank 1 at {sleep}, in no collective" in result.failure
    assert f"the rank that never reached the collective: rank 1, at {sleep} (rank 0's wait timed out)" in result.failure
    assert result.places and result.places in result.failure


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "torchrun"])
def test_the_checkers_timeout_says_where_each_rank_was(stuck_jobs, fork):
    """The exercise checker's ranks, forked (course.exercises.forked) or started by the same launcher, under the
    recorder: its verdict carries the same places, the lines of the learner's script (not the recorder's), and no
    rank is left."""
    from course.exercises import forked
    from course.exercises.results import Stop
    from course.exercises.running import failure

    run = stuck_jobs[f"checker-{fork}"]
    assert forked.live_ranks() == []
    assert run.returncode is None, run.output[-2000:]
    with pytest.raises(Stop) as stop:
        failure(run, STUCK, 30)
    verdict = stop.value.verdict
    sleep = _line_of("time.sleep(3600)  # rank 1")
    assert verdict.diagnosis == "hang" and f"rank 0 in all_reduce at {_line_of('dist.all_reduce')}" in verdict.symptom
    assert f"the rank that never reached the collective: rank 1, at {sleep}" in verdict.symptom, verdict.symptom
    assert verdict.facts["detail"] == run.places


@pytest.mark.parametrize("how", ["interrupt", "kill"])
def test_a_checkers_forked_ranks_end_with_their_caller(tmp_path, how, wait_until):
    """The checker's forked ranks (course.exercises.forked) go with the process that asked for them: an interrupted
    check (a stopped cell: KeyboardInterrupt) ends them, and so does a caller killed outright (a dead kernel: the
    job's watchdog, and the rank server, whose input closes)."""
    import psutil

    # Python's own Ctrl-C handler, as a kernel has one: a process started in the background by a shell without job
    # control (`make test &`, nohup) inherits SIGINT ignored, and Python then installs none (measured: the test
    # failed so in two fresh clones run with nohup)
    code = ("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from pathlib import Path\nfrom course.exercises import running\n"
            f"running.launch(Path({str(STUCK)!r}), ['collective'], Path({str(tmp_path / 'work')!r}), 'gloo', 300, "
            "fork=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    caller = psutil.Process(proc.pid)

    def ranks():
        servers = [p for p in caller.children() if "course.rank_server" in " ".join(p.cmdline())]
        return [servers[0], *servers[0].children()] if servers and len(servers[0].children()) == 2 else None

    started = []
    try:
        started = wait_until(ranks, 90, "the two forked ranks of a check")
        time.sleep(1)  # into the script: rank 0 in its all_reduce, rank 1 asleep
        proc.send_signal(signal.SIGINT) if how == "interrupt" else proc.kill()
        proc.wait(timeout=30)
        wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started), 20,
                   "the server and the ranks to end")
        if how == "interrupt":
            assert "KeyboardInterrupt" in proc.stderr.read().decode()
    finally:
        for p in [caller, *started]:
            with contextlib.suppress(psutil.Error):
                p.kill()
