"""Issue 40: no checkpoint, path or number can hurt the learner. Every probe gets one ``error:`` line before any
process group; nothing in a DCP folder runs as code; a piece damaged after it was written is refused.

The table runs each (script, flag, bad value) in this process, as rank 0 of a made-up torchrun job whose process
group may not start (course's ``run_main`` and ``no_process_group``, from test_model_parallel_args): one case
takes well under a second once torch is imported. Two cases need real processes: what dcp.load itself raises
(torchrun, 2 gloo ranks), and a second plain-torchrun run of train_tp.py into a folder a live one holds (#51.6).
"""

import os
import pickle
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_model_parallel_args import _dcp_folder, _Marker, no_process_group, run_main  # noqa: F401 (a fixture)

from course import import_script
from course.args import LM_SEED_MAX, SEED_MAX, check_gpt_size, lm_seed, output_dir, seed, writable_file
from course.dcp_check import MANIFEST, problem, unverified
from course.launcher import LaunchError, launch
from course.rundir import LOCK, RunDirBusy, claim_run_dir, live_owner, owner_text
from course.train_utils import CourseError, check_folder, check_writable, memory_bytes, number, write_manifest

BIG = "1000000000"
OVER_64_BITS = str(2**64)
UNWRITABLE = "/proc/course-probe"  # /proc takes no new file, even for root

RUN_DIR_SCRIPTS = [("train_lm", 1, []), ("train_tp", 2, []), ("train_pp", 2, []), ("train_2d", 4, []),
                   ("tp_by_hand", 2, []), ("tp_costs", 2, []), ("pp_by_hand", 2, []), ("pp_schedules", 2, []),
                   ("dcp_reshape", 4, ["--save", "{ckpt}"]), ("hsdp_bytes", 4, []), ("mesh_basics", 4, []),
                   ("moe_layer", 2, []), ("shard_memory", 2, []), ("fsdp_checkpoint", 1, ["{dcp}"]),
                   ("train_flowers", 2, ["--image-size", "16"])]

# (script, world size (None: not under torchrun), arguments, words the one error line must hold)
CASES = [
    *[(s, w, [*a, "--run-dir", "{file}"], ["{file}", "is a file"]) for s, w, a in RUN_DIR_SCRIPTS],
    *[(s, w, ["--run-dir", "{file}"], ["argument --run-dir", "{file}", "File exists"]) for s, w in  # plain torch
      (("train_single", 1), ("train_ddp", 2), ("train_fsdp", 2))],
    ("train_lm", 1, ["--run-dir", f"{UNWRITABLE}/run"], ["--run-dir", "cannot write"]),
    ("train_fsdp", 2, ["--run-dir", f"{UNWRITABLE}/run"], ["argument --run-dir", "cannot create", UNWRITABLE]),
    ("train_fsdp", 2, ["--checkpoint", "{file}"], ["argument --checkpoint", "{file}", "is a file"]),  # a DCP folder
    ("train_fsdp", 2, ["--checkpoint", "{file}/ck"], ["argument --checkpoint", "cannot create", "{file}/ck"]),
    ("train_lm", 1, ["--save", f"{UNWRITABLE}/lm.pt"], ["--save", "cannot write"]),
    ("train_tp", 2, ["--save", f"{UNWRITABLE}/tp.pt"], ["--save", "cannot write"]),
    ("train_pp", 2, ["--save", f"{UNWRITABLE}/pp.pt"], ["--save", "cannot write"]),
    ("train_2d", 4, ["--save", f"{UNWRITABLE}/2d.pt"], ["--save", "cannot write"]),
    ("dcp_reshape", 4, ["--save", "{file}/ck"], ["--save", "is a file"]),
    ("dcp_reshape", 4, ["--save", f"{UNWRITABLE}/ck"], ["--save", "cannot write"]),
    ("fsdp_checkpoint", 1, ["{dcp}", "--export", "{file}/x.pt"], ["--export", "is a file"]),
    ("train_lm", 1, ["--lr", "inf"], ["--lr", "finite"]),
    ("train_lm", 1, ["--lr", "nan"], ["--lr", "finite"]),
    ("train_lm", 1, ["--lr=-inf"], ["--lr", "finite"]),
    ("train_tp", 2, ["--lr", "nan"], ["--lr", "finite"]),
    ("train_pp", 2, ["--lr", "inf"], ["--lr", "finite"]),
    ("dcp_reshape", 4, ["--save", "{ckpt}", "--lr", "inf"], ["--lr", "finite"]),
    ("pitfall_pp_hang", 2, ["--timeout", "inf"], ["--timeout", "finite"]),
    ("train_fsdp", 2, ["--lr", "nan"], ["argument --lr", "nan", "(0, 10)"]),
    ("train_lm", 1, ["--seed", OVER_64_BITS], ["--seed", "<="]),
    ("train_2d", 4, ["--seed", OVER_64_BITS], ["--seed", "<="]),
    ("train_flowers", 2, ["--seed", OVER_64_BITS], ["--seed", "<="]),
    *[(s, w, ["--seed", OVER_64_BITS], ["--seed", "2**63"]) for s, w in (("train_single", 1), ("train_ddp", 2),
                                                                           ("train_fsdp", 2))],
    ("train_lm", 1, ["--n-layer", BIG], ["--n-layer", "needs about", "this machine has"]),
    ("train_lm", 1, ["--n-embd", BIG], ["--n-embd", "needs about", "this machine has"]),
    ("train_tp", 2, ["--n-embd", BIG], ["--n-embd", "needs about"]),
    ("train_pp", 2, ["--n-layer", BIG], ["--n-layer", "needs about"]),
    ("train_2d", 4, ["--n-embd", BIG], ["--n-embd", "needs about"]),
    ("tp_costs", 2, ["--n-layer", BIG], ["--n-layer", "needs about"]),
    ("pp_schedules", 2, ["--n-embd", BIG], ["--n-embd", "needs about"]),
    ("pp_by_hand", 2, ["--n-layer", BIG], ["--n-layer", "needs about"]),
    ("tp_by_hand", 2, ["--tokens", BIG], ["--tokens", "needs about"]),
    ("moe_layer", 2, ["--tokens", BIG], ["--tokens", "needs about"]),
    ("pitfall_pp_hang", 2, ["--fix", "--microbatches", BIG], ["--microbatches", "<="]),
    ("train_lm", 2, [], ["--nproc-per-node", "one process"]),
    ("fsdp_checkpoint", None, ["{dcp}"], ["torchrun"]),
    ("dtensor_basics", None, [], ["torchrun"]),
    ("shard_memory", None, [], ["torchrun"]),
    ("train_lm", 1, ["--run-dir", "{busy}"], ["--run-dir", "{busy}", "in use by a live run"]),
    ("train_tp", 2, ["--run-dir", "{busy}"], ["--run-dir", "in use by a live run"]),
    ("fsdp_checkpoint", 1, ["{code}"], ["run code"]),
    ("fsdp_checkpoint", 1, ["{damaged}"], ["does not match its sha256"]),
    ("dcp_reshape", 1, ["--load", "{damaged}", "--dp", "1"], ["--load", "does not match its sha256"]),
]


def _damage_inside_a_piece(folder: Path) -> None:
    """The issue's damage: bytes overwritten in the middle of the largest piece (its first bytes stay right)."""
    info = max(dcp.FileSystemReader(str(folder)).read_metadata().storage_data.values(), key=lambda i: i.length)
    file = folder / info.relative_path
    data = bytearray(file.read_bytes())
    middle = info.offset + info.length // 2
    data[middle:middle + 64] = bytes(64)
    file.write_bytes(bytes(data))


@pytest.fixture
def places(tmp_path):
    """{placeholder: path}: a file, a whole checkpoint, one whose .metadata runs code, one damaged inside, a run
    directory a live run holds."""
    (tmp_path / "file").write_text("not a folder\n")
    code = _dcp_folder(tmp_path / "code")
    (code / ".metadata").write_bytes(pickle.dumps(_Marker(str(tmp_path / "ran"))))
    damaged = _dcp_folder(tmp_path / "damaged")
    write_manifest(damaged)
    _damage_inside_a_piece(damaged)
    with claim_run_dir(tmp_path / "busy"):  # a live run holds it
        yield {"{file}": tmp_path / "file", "{ckpt}": tmp_path / "ckpt", "{dcp}": _dcp_folder(tmp_path / "whole"),
               "{code}": code, "{damaged}": damaged, "{busy}": tmp_path / "busy"}


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize("script, world, argv, words", CASES,
                         ids=[f"{c[0]}-{c[1]}-{' '.join(c[2])}" for c in CASES])
def test_each_probe_gets_one_error_line_before_any_process_group(script, world, argv, words, places, monkeypatch,
                                                                 capsys):
    def fill(text):
        for key, path in places.items():
            text = text.replace(key, str(path))
        return text

    code, err = run_main(script, world, [fill(a) for a in argv], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1, err
    assert all(fill(w) in lines[0] for w in words), lines[0]
    assert "Traceback" not in err
    assert not (places["{file}"].parent / "ran").exists()  # nothing in a checkpoint ran


# ------------------------------------------------------------------------------- the checks themselves


def test_number_refuses_nan_and_inf_and_keeps_its_bounds():
    import argparse

    for text in ("nan", "inf", "-inf", "NaN", "1e400"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite"):
            number(float, 0.0)(text)
    assert number(float, 0.0)("1e-3") == 1e-3 and number(int, 0, high=5)("5") == 5
    with pytest.raises(argparse.ArgumentTypeError, match="<= 5"):
        number(int, 0, high=5)("6")


def test_seeds_are_those_torch_takes():
    """SEED_MAX seeds torch and a sampler's seed + epoch; LM_SEED_MAX seeds course.lm_data's shuffles; one more
    than either is refused by the type, where torch would end in an overflow traceback."""
    import argparse

    torch.manual_seed(SEED_MAX)
    torch.Generator().manual_seed(SEED_MAX + 10_000)  # DistributedSampler seeds with seed + epoch
    with pytest.raises((RuntimeError, ValueError)):
        torch.manual_seed(2**64)
    from course.lm_data import load_lm_data

    load_lm_data(batch_size=4).batch("train", 10_000, 4, seed=lm_seed(str(LM_SEED_MAX)))
    for parse, bad in ((seed, SEED_MAX + 1), (seed, -1), (lm_seed, LM_SEED_MAX + 1)):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(str(bad))


def test_the_memory_estimate_passes_the_course_sizes_and_names_both_numbers():
    class Args:
        n_layer, n_embd, n_head, batch_size = 2, 64, 4, 64

    class Data:
        vocab_size, block_size = 14, 8

    errors = []

    class Parser:
        def error(self, message):
            errors.append(message)

    check_gpt_size(Parser(), Args(), Data())
    assert errors == []
    Args.n_embd = int(BIG)
    check_gpt_size(Parser(), Args(), Data())
    assert len(errors) == 1 and f"this machine has {memory_bytes() / 1e9:,.1f} GB" in errors[0]


def test_the_path_checks_probe_and_leave_nothing(tmp_path):
    folder = tmp_path / "a" / "b"
    assert output_dir(str(folder)) == str(folder) and not (tmp_path / "a").exists()  # probed above, not created
    check_folder(folder)
    assert folder.is_dir() and list(folder.iterdir()) == []  # created; the probe file is gone
    assert writable_file(str(folder / "x.pt")) and list(folder.iterdir()) == []
    (tmp_path / "f").write_text("")
    for bad in (tmp_path / "f", tmp_path / "f" / "run", Path(UNWRITABLE) / "run"):
        with pytest.raises(CourseError, match="cannot write"):
            check_folder(bad)
    with pytest.raises(CourseError, match="it is a folder"):
        check_writable(folder)


# ------------------------------------------------------------------------------------ the DCP manifest


def test_a_manifest_lets_a_whole_checkpoint_load_and_refuses_each_damage(tmp_path):
    folder = _dcp_folder(tmp_path / "ckpt")
    assert problem(folder) is None and MANIFEST in unverified(folder)  # written elsewhere: loads, not verified
    write_manifest(folder)
    assert problem(folder) is None and unverified(folder) is None
    assert not list(folder.glob(f".{MANIFEST}*"))  # its temporary file was renamed into place
    state = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder))
    assert state["step"] == 3 and state["model"]["w"].abs().sum() > 0

    _damage_inside_a_piece(folder)
    why = problem(folder)
    assert why is not None and str(folder) in why and "sha256" in why and "\n" not in why, why


@pytest.mark.parametrize("change", ["metadata", "extra piece", "bad manifest", "manifest names a missing file"])
def test_a_manifest_that_does_not_match_refuses_the_folder(change, tmp_path):
    folder = _dcp_folder(tmp_path / "ckpt")
    write_manifest(folder)
    if change == "metadata":  # a .metadata swapped after the save: refused before it is unpickled
        (folder / ".metadata").write_bytes(pickle.dumps(_Marker(str(tmp_path / "ran"))))
    elif change == "extra piece":
        (folder / "__9_0.distcp").write_bytes(b"PK\x03\x04")
    elif change == "bad manifest":
        (folder / MANIFEST).write_text("{")
    else:
        (folder / MANIFEST).write_text('{"sha256": {"__7_0.distcp": "00"}}')
    why = problem(folder)
    assert why is not None and str(folder) in why, why
    assert not (tmp_path / "ran").exists()


def test_metadata_classes_beyond_dcps_own_are_refused(tmp_path):
    """A DCP class that is not metadata (a writer, which makes folders) is code too: refused."""
    from torch.distributed.checkpoint import FileSystemWriter

    folder = _dcp_folder(tmp_path / "ckpt")
    made = tmp_path / "made"

    class Writer:
        def __reduce__(self):
            return (FileSystemWriter, (str(made),))

    (folder / ".metadata").write_bytes(pickle.dumps(Writer()))
    assert "run code" in problem(folder) and not made.exists()


# ------------------------------------------------------------------------------ real processes, one case


def test_fsdp_checkpoint_on_a_foreign_checkpoint_is_one_line_under_torchrun(tmp_path):
    """A DCP folder of another model (no manifest: written elsewhere): one note that it is not verified, then one
    error line from rank 0, no rank's traceback, on a job of 2 processes."""
    folder = _dcp_folder(tmp_path / "foreign")
    result = launch("fsdp_checkpoint.py", nproc=2, args=[str(folder)], timeout=120, check=False,
                    on_line=lambda _: None)
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1 and "could not be loaded" in errors[0], result.output
    assert f"checkpoint {folder} has no {MANIFEST}" in result.output and "weights_only" not in result.output
    assert not [line for line in result.output.splitlines() if line.startswith("[rank") and "Traceback" in line]


# ---------------------------------------------------------------------- one live run per run directory (#51.6)

# The scripts of 08 and 10-12 that write into --run-dir under plain torchrun (train_fsdp.py, plain torch like the
# take-home scripts, does not claim it); each claims it before its process group, on the rank that writes it.
CLAIMING = [(s, w, a) for s, w, a in RUN_DIR_SCRIPTS if s not in ("train_fsdp", "train_ddp", "train_flowers")]
WRITER = {"train_pp": "last"}  # the rank that writes the run directory, where it is not rank 0


class _Reached(Exception):
    """The script reached its process group (train_lm, one process: its device): as far as the case goes."""


def _close_claims(folder: Path) -> None:
    """Close this process's open claim on ``folder`` (the script's Claim, left open when _Reached stopped it)."""
    try:
        lock = os.stat(folder / LOCK)
    except FileNotFoundError:
        return
    for fd in os.listdir("/dev/fd"):
        try:
            if os.fstat(int(fd)).st_ino == lock.st_ino and os.fstat(int(fd)).st_dev == lock.st_dev:
                os.close(int(fd))
        except OSError:
            pass


@pytest.mark.parametrize("staged", [False, True], ids=["plain torchrun", "under the launcher"])
@pytest.mark.parametrize("script, world, argv", CLAIMING, ids=[c[0] for c in CLAIMING])
def test_each_script_claims_its_run_dir_before_the_process_group(script, world, argv, staged, places, tmp_path,
                                                                 monkeypatch):
    """Run as the rank that writes, each script holds its --run-dir (course.rundir's claim, this process the
    owner) by the time it starts the process group; under course.launcher (COURSE_STAGED=1), which holds the
    claim itself, it takes none."""
    import torch.distributed as dist
    from torch.distributed import device_mesh

    run_dir = tmp_path / "run"
    seen = []

    def reached(*args, **kwargs):
        seen.append(live_owner(run_dir))
        raise _Reached

    for module, name in [(dist, "init_process_group"), (dist.distributed_c10d, "init_process_group"),
                         (device_mesh, "init_device_mesh")]:
        monkeypatch.setattr(module, name, reached)
    module = import_script(script)
    if script == "train_lm":
        monkeypatch.setattr(module, "pick_device", reached)
    rank = world - 1 if WRITER.get(script) == "last" else 0
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # this process looks at its own claim: not one job
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
                        "COURSE_STAGED": int(staged)}.items():
        monkeypatch.setenv(name, str(value))
    filled = [str(places.get(a, a)) for a in argv]
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *filled, "--run-dir", str(run_dir)])
    try:
        with pytest.raises(_Reached):
            module.main()
    finally:
        _close_claims(run_dir)
    assert seen == [None if staged else owner_text()]


def test_a_second_plain_torchrun_run_of_train_tp_into_a_live_runs_folder_is_refused_in_one_line(tmp_path):
    """The issue's case: train_tp.py under plain torchrun (the course launcher without run_dir= is torchrun and
    nothing more) holds --run-dir while it trains; a second job into the same folder ends with one error line
    naming it and its owner, before any process group, and writes nothing there. One process each, to keep it
    cheap (test_once_per_job_under_torchrun: the line is said once by a job of 2)."""
    run_dir, stop, first = tmp_path / "run", threading.Event(), {}

    def hold():
        try:
            first["result"] = launch("train_tp.py", nproc=1, timeout=300, check=False, stop=stop, quiet=True,
                                     args=["--steps", "100000", "--log-every", "100000", "--save", "",
                                           "--run-dir", run_dir], on_line=lambda _: None)
        except LaunchError as stopped:  # "job stopped": what stop= does
            first["stopped"] = stopped

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        deadline = time.monotonic() + 120
        while (owner := live_owner(run_dir)) is None and holder.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert owner is not None, f"the first run never claimed {run_dir}: {first}"
        second = launch("train_tp.py", nproc=1, args=["--steps", "1", "--save", "", "--run-dir", run_dir],
                        timeout=120, check=False, quiet=True, on_line=lambda _: None)
    finally:
        stop.set()
        holder.join(60)
    errors = [line for line in second.output.splitlines() if "error:" in line]
    assert second.returncode != 0 and len(errors) == 1, second.output
    assert f"{run_dir} is in use by a live run ({owner})" in errors[0], errors[0]
    assert "rank 0 exited with code 2" in second.failure, second.failure
    assert not [line for line in second.output.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert not (run_dir / "metrics.json").exists() and "stopped" in first, first
    assert live_owner(run_dir) is None  # the first run stopped: its claim went with it


def test_a_claim_by_a_rank_of_the_same_torchrun_job_is_not_another_live_run(tmp_path, monkeypatch):
    """The rank that writes claims --run-dir right after parsing its flags; the job's other ranks may parse later,
    and JobParser's look (live_owner) must not take their own job's claim for another run. The claim records the
    torchrun job (TORCHELASTIC_RUN_ID, a fresh uuid per --standalone job); another job, or a process outside
    torchrun, still sees it busy, and the error names only "host pid"."""
    run_dir = tmp_path / "run"
    me = f"{socket.gethostname()} {os.getpid()}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    with claim_run_dir(run_dir):
        assert (run_dir / LOCK).read_text() == f"{me}\njob job-a"
        assert live_owner(run_dir) is None  # a rank of job-a, looking after its own job claimed
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        assert live_owner(run_dir) == me
        with pytest.raises(RunDirBusy) as busy:
            claim_run_dir(run_dir)
        assert f"in use by a live run ({me})" in str(busy.value) and "\n" not in str(busy.value)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert live_owner(run_dir) == me
