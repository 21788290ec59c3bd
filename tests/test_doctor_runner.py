"""The doctor's runner (issue 41 items 1, 2, 4; issue 42 items 2, 6): scripts as people write them run on a CPU
machine (written for CUDA and NCCL: the CPU stand-in; starting their own processes: run once as ``python
script.py``; ``--local_rank``; ``tcp://`` and hard-coded ports), and every run is bounded and clean (a second
doctor, Ctrl+C, deleted files, a rank stuck outside any collective, a rank that fails, torchrun's log folders).
In-process checks first; the few launched ones use the scripts of tests/fixtures/doctor_runner."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from course import ROOT
from ddp_doctor import check, doctor_folder
from ddp_doctor.__main__ import main
from ddp_doctor.recorder import ENTRY
from ddp_doctor.rundir import claim_run_dir
from ddp_doctor.running import Job, Run, _put_back, style

FIXTURES = ROOT / "tests" / "fixtures" / "doctor_runner"

PROBE = '''
import json, os, sys, time, warnings
sys.path.insert(0, {folder!r})
os.environ.update(LOCAL_RANK="1", NCCL_DEBUG="INFO", NCCL_SOCKET_IFNAME="eth0")
import torch
import torch.distributed as dist
import recorder_standin

record = {{}}

def where():
    frame = sys._getframe(1)
    while frame and frame.f_code.co_filename != __file__:
        frame = frame.f_back
    return f"probe:{{frame.f_lineno}}" if frame else ""

recorder_standin.install(record, where, pretend={pretend}, gpus=2)
x = torch.ones(2)


def timed():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(torch.cuda.Stream()):
        start.record()
        time.sleep(0.05)
        end.record()
    torch.cuda.current_stream().synchronize()
    torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
    return start.elapsed_time(end)


def load():
    torch.save({{"w": torch.ones(1)}}, sys.argv[1])
    return torch.load(sys.argv[1], map_location="cuda:0")["w"].device.type


def groups():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dist.barrier(device_ids=[0])
    return [dist.get_backend(), dist.new_group(backend="nccl") is not None]


def sync_bn():
    bn = torch.nn.SyncBatchNorm(3).cuda()
    return [torch.nn.parallel.DistributedDataParallel(bn, device_ids=[0]).module(torch.randn(4, 3)).shape[0],
            hasattr(torch.nn.SyncBatchNorm.forward, "__wrapped__")]


def amp():
    with torch.autocast("cuda", dtype=torch.float16):
        enabled = torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    return [enabled, torch.amp.GradScaler("cuda").is_enabled(), torch.cuda.amp.GradScaler().is_enabled()]


def loader():
    data = torch.utils.data.TensorDataset(torch.ones(4, 2))
    return next(iter(torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True)))[0].is_pinned()


PROBES = {{
    "available": lambda: [torch.cuda.is_available(), torch.cuda.is_bf16_supported(), torch.backends.cudnn.is_available()],
    "count": lambda: [torch.cuda.device_count(), torch.accelerator.device_count()],
    "current": lambda: [torch.cuda.current_device(), torch.accelerator.current_device_index()],
    "accelerator": lambda: [torch.accelerator.is_available(), str(torch.accelerator.current_accelerator())],
    "properties": lambda: [torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory > 0,
                           list(torch.cuda.get_device_capability())],
    "memory_info": lambda: [torch.cuda.mem_get_info()[1] > 0, torch.cuda.utilization()],
    "no_op": lambda: [torch.cuda.set_device(1), torch.cuda.synchronize(), torch.cuda.empty_cache(),
                      torch.cuda.ipc_collect(), torch.accelerator.set_device_index(1), torch.accelerator.synchronize(),
                      torch.cuda.device(1).__enter__()],
    "memory_stats": lambda: [torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved(),
                             torch.cuda.reset_peak_memory_stats(), "stand-in" in torch.cuda.memory_summary()],
    "streams": lambda: 40 <= timed() < 5000,
    "devices": lambda: sorted({{t.device.type for t in (
        torch.zeros(2, device="cuda"), x.to(0), x.to("cuda:1", non_blocking=True), x.to(torch.device("cuda", 0)),
        x.to(device="cuda"), x.to(torch.device("cuda")), x.cuda(),
        next(torch.nn.Linear(2, 2).to(1).parameters()), next(torch.nn.Linear(2, 2).cuda().parameters()))}}),
    "pinned": lambda: [x.pin_memory().device.type, x.cuda(non_blocking=True).device.type, loader()],
    "cudnn": lambda: [setattr(torch.backends.cudnn, "benchmark", True), setattr(torch.backends.cudnn, "deterministic", True),
                      setattr(torch.backends.cudnn, "allow_tf32", True), torch.backends.cudnn.benchmark],
    "amp": amp,
    "groups": groups,
    "ddp": lambda: next(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2).cuda(), device_ids=[0],
                                                                  output_device=0).parameters()).device.type,
    "sync_bn": sync_bn,
    "load": load,
    "nccl_env": lambda: sorted(k for k in os.environ if k.startswith("NCCL_")),
}}
assert PROBES.keys() == recorder_standin.INVENTORY.keys(), set(PROBES) ^ set(recorder_standin.INVENTORY)
seen = {{}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for name, probe in PROBES.items():
        try:
            seen[name] = probe()
        except Exception as error:
            seen[name] = f"{{type(error).__name__}}: {{error}}"
    seen["torch_sees"] = not torch.cuda.amp.common.amp_definitely_not_available()
seen["warnings"] = [str(w.message) for w in caught if "cuda" in str(w.message).lower() or "pin" in str(w.message)]
seen["sites"] = record.get("standin", [])
print(json.dumps(seen))
'''


def _probe(tmp_path, pretend: bool) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(folder=str(ENTRY.parent), pretend=pretend))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "w.pt")], check=False, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_cpu_standin_answers_its_whole_inventory(tmp_path):
    """Issue 54 item 2: every entry of the stand-in's inventory (recorder_standin.INVENTORY) asked as a CUDA script
    asks it, pretending 2 GPUs on a node, as local rank 1: consistent answers, every tensor on the CPU, no warning.
    SyncBatchNorm's statistics over 2 ranks: the doctor case published-guard-syncbn (tests/test_doctor.py)."""
    seen = _probe(tmp_path, pretend=True)
    assert seen["available"] == [True, True, True] and seen["count"] == [2, 2], seen
    assert seen["current"] == [1, 1] and seen["accelerator"] == [True, "cuda"], seen  # LOCAL_RANK, of 2
    assert seen["properties"] == ["CPU (the doctor's stand-in)", True, [8, 0]], seen
    assert seen["memory_info"] == [True, 0] and seen["no_op"] == [None] * 7, seen
    assert seen["memory_stats"] == [0, 0, None, True] and seen["streams"] is True, seen  # events time the CPU
    assert seen["devices"] == ["cpu"] and seen["pinned"] == ["cpu", "cpu", False], seen
    assert seen["cudnn"] == [None, None, None, True] and seen["amp"] == [False, False, False], seen
    assert seen["groups"] == ["gloo", True] and seen["ddp"] == "cpu" and seen["sync_bn"] == [4, True], seen
    assert seen["load"] == "cpu" and seen["nccl_env"] == ["NCCL_DEBUG", "NCCL_SOCKET_IFNAME"], seen
    assert seen["torch_sees"] is False, seen  # torch's internals still see the CPU
    assert seen["warnings"] == [], seen  # disabled as on a CPU, without a warning per call
    # one site per line of the probe that was redirected, each once
    assert len(seen["sites"]) == len(set(seen["sites"])) >= 25, seen["sites"]


def test_without_pretending_the_script_is_told_the_truth(tmp_path):
    seen = _probe(tmp_path, pretend=False)
    assert seen["available"][0] is False and seen["count"] == [0, 0], seen
    assert seen["accelerator"][0] is False and seen["devices"] == ["cpu"], seen


def test_the_launch_style_and_the_standin_are_read_from_the_code(tmp_path):
    spawn = style(FIXTURES / "tutorial_spawn.py", gpus=0, nproc=2)
    assert spawn == {"launch": "spawn", "standin": True, "pretend": True, "local_rank_arg": ""}
    torchrun = style(FIXTURES / "tutorial_torchrun.py", gpus=0, nproc=2)
    assert torchrun["launch"] == "torchrun" and torchrun["standin"] and torchrun["pretend"]
    assert style(FIXTURES / "launch_style.py", gpus=0, nproc=2)["local_rank_arg"] == "--local_rank"
    assert style(FIXTURES / "tutorial_torchrun.py", gpus=2, nproc=2)["standin"] is False  # enough GPUs
    # a CPU script, and a portable one (it asks is_available(): it keeps its CPU path)
    assert style(FIXTURES / "stuck_rank.py", gpus=0, nproc=2)["standin"] is False
    portable = style(ROOT / "tests" / "fixtures" / "doctor" / "nanogpt_loop.py", gpus=0, nproc=2)
    assert portable["standin"] and not portable["pretend"]
    words = tmp_path / "words.py"  # only its docstring and comments mention spawn and cuda
    words.write_text('"""Unlike mp.spawn(run, nprocs=2) scripts, this one uses torchrun; no cuda."""\n'
                     "import torch  # not nccl\nprint(torch.ones(1))\n")
    assert style(words, gpus=0, nproc=2) == {"launch": "torchrun", "standin": False, "pretend": False,
                                             "local_rank_arg": ""}


def test_two_projects_scripts_of_one_name_get_two_folders(tmp_path, monkeypatch):
    a, b = tmp_path / "a" / "train.py", tmp_path / "b" / "train.py"
    assert doctor_folder(a) != doctor_folder(b)
    assert doctor_folder(a).name.startswith("train-") and doctor_folder(a) == doctor_folder(a)
    monkeypatch.chdir(tmp_path)  # relative to where the doctor runs, never to where it is installed
    assert doctor_folder(a) == tmp_path / "runs" / "doctor" / doctor_folder(a).name == doctor_folder(a, tmp_path)


def test_a_second_doctor_on_the_same_script_gets_one_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    folder = doctor_folder(script)
    try:
        with claim_run_dir(folder):
            assert main([str(script)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: another doctor is checking"), err
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_ctrl_c_gets_one_line(tmp_path, capsys, monkeypatch):
    import ddp_doctor.doctor

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ddp_doctor.doctor, "check", interrupted)
    assert main([str(tmp_path / "train.py")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: interrupted"), err


def test_files_are_put_back_from_the_copies_alone(tmp_path):
    """An interrupted job leaves no record: the copies' own notes say where each file goes back."""
    out, learner = tmp_path / "out", tmp_path / "learner"
    (out / "protected").mkdir(parents=True)
    learner.mkdir()
    (out / "protected" / "k1").write_text("original")
    (out / "protected" / "k1.path").write_text(str(learner / "sub" / "data.txt"))  # deleted with its folder
    (out / "protected" / "k2.path").write_text(str(learner / "gone.txt"))  # its copy never completed
    run = Run(Job(learner / "s.py", [], cwd=learner), None, "", {}, {}, 0.0)
    _put_back(run, out, out / "files")
    assert (learner / "sub" / "data.txt").read_text() == "original"
    assert run.restored == [str(learner / "sub" / "data.txt")] and run.lost == [str(learner / "gone.txt")]


# launched: each needs processes (about 20-60 s each on 2 busy cores)

def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copy(FIXTURES / name, target)
    return target


def test_a_cuda_nccl_script_is_checked_on_the_cpu(tmp_path):
    """The tutorial series' torchrun script as published: nccl, .to(local_rank), device_ids. Exit 1 with its
    real mistake; the first line names the stand-in; torchrun leaves no log folder in the temporary folder."""
    script = _copy("tutorial_torchrun.py", tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ddp_doctor", str(script), "2", "1"], check=False,
                         capture_output=True, text=True, cwd=tmp_path, timeout=240,
                         env={**os.environ, "TMPDIR": str(tmp)})
    first = out.stdout.splitlines()[0]
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CUDA/NCCL on a CPU stand-in at " in first and "[set-epoch]" in out.stdout, out.stdout
    assert "what needs a GPU" in out.stdout and "NCCL-only behaviour" in out.stdout
    assert not list(tmp.glob("torchelastic_*")) and not list(tmp.glob("course-torchrun-*")), list(tmp.iterdir())
    assert time.monotonic() - start < 240
    assert doctor_folder(script, tmp_path).is_dir()  # runs/doctor/... in the folder it was started in


def test_a_script_that_spawns_its_own_processes_runs_once(tmp_path):
    """The pytorch.org DDP tutorial's shape: mp.spawn, a hard-coded MASTER_PORT, nccl, device_count(). Run once
    as `python script.py` with the recorder in both processes it starts: its real mistake, no false one."""
    script = _copy("tutorial_spawn.py", tmp_path)
    report = check(script, cwd=tmp_path, folder=tmp_path / "doctor", show=False, timeout=300)
    assert report.status == 1 and [f.code for f in report.mistakes] == ["rank-writes"], report.text()
    assert not report.error, report.text()  # it ended by itself
    assert "model.checkpoint" in report.mistakes[0].evidence and "/tmp\n" not in report.text()
    assert "started once" in report.command and "CPU stand-in" in report.command, report.command
    records = sorted((tmp_path / "doctor" / "job").glob("record_rank*.json"))
    assert [r.name for r in records] == ["record_rank0.json", "record_rank1.json"]  # 2 ranks, not 2 x 2


def test_a_script_whose_helper_spawns_is_run_once_never_two_worlds(tmp_path):
    """mp.spawn inside a helper module: the source of the script says nothing, so it first runs under torchrun;
    each rank ends at the first process it would start, and the doctor runs it again as `python script.py`."""
    script = _copy("hidden_spawn.py", tmp_path)
    _copy("spawn_helper.py", tmp_path)
    assert style(script, gpus=0, nproc=2)["launch"] == "torchrun"
    report = check(script, cwd=tmp_path, folder=tmp_path / "doctor", show=False, timeout=120)
    assert report.status == 0 and not report.findings and not report.error, report.text()
    assert "started once" in report.command and "hidden_spawn.py:36" in report.command, report.command
    first = [json.loads(r.read_text()) for r in sorted((tmp_path / "doctor" / "job").glob("record_rank*.json"))]
    assert len(first) == 2 and all(e["in"] == "spawn" for r in first for e in r["errors"]), first
    records = sorted((tmp_path / "doctor" / "job-spawn").glob("record_rank*.json"))
    assert [r.name for r in records] == ["record_rank0.json", "record_rank1.json"]  # 2 ranks, not 2 x 2
    assert report.seconds < 100, report.text()


def test_forked_processes_are_recorded_as_ranks(tmp_path):
    """multiprocessing's fork context: each child is a copy of the recorded parent; its record starts afresh and
    the real mistake is found from both ranks."""
    script = _copy("fork_workers.py", tmp_path)
    report = check(script, cwd=tmp_path, folder=tmp_path / "doctor", show=False, timeout=120)
    assert report.status == 1 and [f.code for f in report.mistakes] == ["set-epoch"], report.text()
    assert "started once" in report.command, report.command
    records = [json.loads(r.read_text()) for r in sorted((tmp_path / "doctor" / "job").glob("record_rank*.json"))]
    assert [r["rank"] for r in records] == [0, 1] and all(len(r["samplers"]) == 2 for r in records), records


def test_a_launch_style_script_with_tcp_init_is_clean(tmp_path):
    """--local_rank given as torch.distributed.launch gave it; init_method="tcp://..." with its own port;
    autocast("cuda") and GradScaler("cuda"); a correct script: no finding."""
    script = _copy("launch_style.py", tmp_path)
    report = check(script, cwd=tmp_path, folder=tmp_path / "doctor", show=False, timeout=300)
    assert report.status == 0 and not report.findings, report.text()
    assert "given --local_rank" in report.command and "CPU stand-in" in report.command, report.command


def test_a_rank_stuck_outside_any_collective_is_named_at_hang_after(tmp_path):
    script = _copy("stuck_rank.py", tmp_path)
    report = check(script, cwd=tmp_path, folder=tmp_path / "doctor", show=False, timeout=300, hang_after=5)
    hang = [f for f in report.findings if f.code == "hang"]
    assert hang and "rank 1 at stuck_rank.py:13, in no collective" in hang[0].evidence, report.text()
    assert "rank 0 in broadcast at stuck_rank.py:14" in hang[0].evidence, report.text()
    assert "5 s process-group timeout ended it" in hang[0].seen, report.text()  # not the job's 300 s limit


def test_a_failed_rank_ends_the_job_and_deleted_files_come_back(tmp_path):
    """As under torchrun: one rank's own error ends the job (the other would sleep 120 s); the file it deleted
    is restored."""
    script = _copy("rank_dies.py", tmp_path)
    data = tmp_path / "data.txt"
    data.write_text("keep")
    os.utime(data, (time.time() - 3600,) * 2)
    report = check(script, cwd=tmp_path, folder=tmp_path / "doctor", show=False, timeout=300)
    assert report.status == 2 and "rank 0 fails on its own" in report.error, report.text()
    assert any("a rank failed: the others were ended" in u for u in report.unchecked), report.text()
    assert not any(f.code == "hang" for f in report.findings), report.text()
    assert data.read_text() == "keep"
    assert report.seconds < 200, report.text()  # the other rank would have slept 120 s after a slow start


def _recorded(script: str, tmp_path: Path, **extra) -> tuple[subprocess.Popen, Path]:
    """``script`` run by the recorder alone (one process, rank 0), its records in tmp_path/out; ``extra``: more
    environment (COURSE_RECORD_TRAINING="1": the doctor's training recorder too)."""
    path, out = tmp_path / "script.py", tmp_path / "out"
    path.write_text(script)
    out.mkdir()
    env = {**os.environ, "COURSE_RECORD_OUT": str(out), "PYTHONUNBUFFERED": "1", **extra}
    return subprocess.Popen([sys.executable, str(ENTRY), str(path)], env=env, stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path), out


def test_a_hang_dump_writes_the_record_before_the_stack(tmp_path):
    """Issue 51 (pitfall-12 under load: "rank 1 left no record"): the runner stops a job once every rank has said
    where it is; the stack file is written last, so once it is there the record is whole (it was written after it,
    and a rank stopped meanwhile left no record)."""
    proc, out = _recorded("import time\nprint('ready', flush=True)\ntime.sleep(60)\n", tmp_path)
    try:
        assert proc.stdout.readline().strip() == "ready"
        (out / "dump-now").touch()
        stuck = out / "stuck_rank0.json"
        deadline = time.monotonic() + 20
        while not stuck.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        record = out / "record_rank0.json"
        assert stuck.exists() and record.exists(), sorted(p.name for p in out.iterdir())
        assert record.stat().st_mtime_ns <= stuck.stat().st_mtime_ns
        said = json.loads(stuck.read_text())
        assert said["leaving"] is False and said["stack"][-1]["line"] == 3, said
        assert json.loads(record.read_text())["ended"] is False
    finally:
        proc.kill()
        proc.wait()


PAST_ITS_SCRIPT = '''import atexit, json, os, time
OUT = os.environ["COURSE_RECORD_OUT"]

def after():  # the script has ended; the recorder's last record comes after this (atexit: last in, first out)
    open(os.path.join(OUT, "dump-now"), "w").close()
    record = os.path.join(OUT, "record_rank0.json")
    deadline = time.monotonic() + 20
    while not os.path.exists(record) and time.monotonic() < deadline:
        time.sleep(0.02)
    print(json.dumps({"ended": json.load(open(record))["ended"],
                      "stuck": os.path.exists(os.path.join(OUT, "stuck_rank0.json"))}), flush=True)

atexit.register(after)
'''


def test_a_rank_past_its_script_answers_with_its_last_record(tmp_path):
    """A rank asked where it is while it exits: not a hang's dump (a record saying it had not ended, which the runner
    would wait on or stop in the middle of) but its last record, once."""
    proc, out = _recorded(PAST_ITS_SCRIPT, tmp_path)
    answer, _ = proc.communicate(timeout=120)
    assert json.loads(answer.strip().splitlines()[-1]) == {"ended": True, "stuck": False}, answer
    assert json.loads((out / "record_rank0.json").read_text())["ended"] is True
    assert not list(out.glob("*.tmp")), sorted(p.name for p in out.iterdir())


def _watch_job(out: Path, nodes: int = 2):
    import threading

    from ddp_doctor.running import _stop_when_hung

    out.mkdir(parents=True, exist_ok=True)
    job = Job(out / "x.py", [], nproc=2, nodes=nodes, timeout=120)
    stop, done, why = threading.Event(), threading.Event(), []
    watcher = threading.Thread(target=_stop_when_hung, args=(out, job, stop, done, why), daemon=True)
    watcher.start()
    return stop, done, why


def _record(out: Path, rank: int, failed: bool, pid: int, ended: bool = True) -> None:
    errors = [{"in": "script", "error": "RuntimeError: x"}] if failed else []
    (out / f"record_rank{rank}.json").write_text(json.dumps({"ended": ended, "errors": errors, "pid": pid}))


def test_the_runner_waits_for_the_last_record_of_a_rank_on_its_way_out(tmp_path):
    """Rank 0 failed; rank 1's collective failed too (``leaving``): its stack is not the end of what it says, its
    last record is; the job is stopped only once that is written."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    out = tmp_path / "out"
    out.mkdir()
    _record(out, 0, failed=True, pid=proc.pid)
    stop, done, why = _watch_job(out)
    try:
        deadline = time.monotonic() + 15
        while not (out / "dump-now").exists() and time.monotonic() < deadline:  # rank 0 failed 2 s ago
            time.sleep(0.05)
        assert (out / "dump-now").exists() and why == ["failed", "runner"], why
        (out / "stuck_rank1.json").write_text(json.dumps({"leaving": True, "stack": []}))
        assert not stop.wait(1.5)  # said where it is, but on its way out: its last record is still to come
        _record(out, 1, failed=True, pid=proc.pid)
        assert stop.wait(3)
    finally:
        done.set()


def test_the_runner_ends_a_job_whose_ranks_have_all_exited(tmp_path):
    """Issue 51 (the rank-0 evaluation case, 186 s in 3 of 5 runs): rank 1 succeeded, rank 0 failed, both processes
    have exited; torchrun's agent of rank 1's node waits in its exit barrier (300 s) for the other node's agent,
    which exited without it. The runner ends the job then, not at its timeout, and asks nobody where it is."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    out = tmp_path / "out"
    out.mkdir()
    _record(out, 0, failed=True, pid=proc.pid)
    _record(out, 1, failed=False, pid=proc.pid)
    start = time.monotonic()
    stop, done, why = _watch_job(out)
    try:
        assert stop.wait(20) and why == ["exited"], why
        assert time.monotonic() - start < 15 and not (out / "dump-now").exists()
    finally:
        done.set()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # a rank whose process is still running (on its way out): not ended by this rule
        (out2 := tmp_path / "out2").mkdir()
        _record(out2, 0, failed=True, pid=proc.pid)
        _record(out2, 1, failed=False, pid=live.pid)
        stop, done, why = _watch_job(out2)
        assert not stop.wait(8) and why == [], why
        done.set()
    finally:
        live.kill()
        live.wait()


def test_launch_as_the_user_says_and_a_first_process_failure_is_named(tmp_path, capsys):
    """Issue 54 item 3: ``--launch spawn`` is kept even where the script then asks for torchrun's variables (the
    default would have rerun it under torchrun, tests/test_doctor_public.py); exit 2 names the error of the
    script's first process and its line, not the recorder's traceback."""
    script = tmp_path / "imagenet_main.py"
    shutil.copy(ROOT / "tests" / "fixtures" / "doctor_public" / "imagenet_main.py", script)
    code = main(["--launch", "spawn", "--out", str(tmp_path / "doctor"), str(script), "--dist-url", "env://",
                 "--world-size", "-1"])
    shown = capsys.readouterr().out
    assert code == 2 and "launched as `--launch spawn` asked" in shown, shown
    assert "the script's first process at imagenet_main.py:42 `args.world_size = int(os.environ[\"WORLD_SIZE\"])`: " \
           "KeyError: 'WORLD_SIZE'" in shown and "recorder.py" not in shown, shown


TWO_WORLDS = '''import torch, torch.distributed as dist
from torch import nn

def world(steps, lr):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        dist.all_reduce(torch.zeros(1))
        opt.step()
    dist.destroy_process_group()

world(3, 0.1)
world(2, 0.2)
'''


def test_each_world_is_recorded_on_its_own(tmp_path):
    """Issue 54 item 4: a script that makes a process group, destroys it and makes another has the first world's
    facts kept in ``worlds`` and the record of the last one alone (its steps, collectives, models); each world is
    checked on its own, and a mistake of the first is told as found there (records built by hand: two ranks whose
    gradients differ in the first world only)."""
    proc, out = _recorded(TWO_WORLDS, tmp_path, COURSE_RECORD_TRAINING="1")
    proc.communicate(timeout=120)
    record = json.loads((out / "record_rank0.json").read_text())
    assert [len(w["facts"]["steps"]) for w in record["worlds"]] == [3] and record["worlds"][0]["pg"]["where"].endswith(":5")
    assert len(record["steps"]) == 2 and len(record["modules"]) == 1 and len(record["grads"]) == 2
    assert sum(c.get("op") == "all_reduce" for c in record["collectives"]) == 2, record["collectives"]
    from ddp_doctor.doctor import diagnose

    records = {r: {**record, "env": {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": str(r)},
                   "rank": r, "pg": {**record["pg"], "rank": r, "world_size": 2},
                   "worlds": [{**w, "pg": {**w["pg"], "rank": r, "world_size": 2}} for w in record["worlds"]]}
               for r in (0, 1)}
    report = diagnose(Run(Job(tmp_path / "script.py", [], nproc=2, nodes=2, cwd=tmp_path), 0, "", records, {}, 1.0))
    same = {f.code for f in report.findings}  # the hand-made ranks' own (both worlds: rank=0 given, same data)
    assert any(c.startswith("each of the 2 process groups the script made one after another on its own (the first "
                            "at ") for c in report.checked), report.text()
    assert "grads-not-averaged" not in same and len(record["worlds"][0]["facts"]["grads"]) == 3, report.text()
    other = json.loads(json.dumps(records[1]))
    for grad in other["worlds"][0]["facts"]["grads"]:
        grad["fp"] = [[v + 1.0 for v in fp] if fp else fp for fp in grad["fp"]]
    report = diagnose(Run(Job(tmp_path / "script.py", [], nproc=2, nodes=2, cwd=tmp_path), 0, "",
                          {0: records[0], 1: other}, {}, 1.0))
    found = {f.code: f for f in report.findings}
    assert set(found) == same | {"grads-not-averaged"}, report.text()
    assert found["grads-not-averaged"].evidence.startswith("in process group 1 of 2: before optimizer step 0"), \
        report.text()
