"""Issue 40: no checkpoint, path or number can hurt the learner. Every probe gets one ``error:`` line before any
process group; nothing in a DCP folder runs as code; a piece damaged after it was written is refused.

The table runs each (script, flag, bad value) in this process, as rank 0 of a made-up torchrun job whose process
group may not start (course's ``run_main`` and ``no_process_group``, from test_model_parallel_args): one case
takes well under a second once torch is imported. One case needs real processes (torchrun, 2 gloo ranks):
what dcp.load itself raises.
"""

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_model_parallel_args import _dcp_folder, _Marker, no_process_group, run_main  # noqa: F401 (a fixture)

from course.args import LM_SEED_MAX, SEED_MAX, check_gpt_size, lm_seed, output_dir, seed, writable_file
from course.dcp_check import MANIFEST, problem, unverified
from course.launcher import launch
from course.rundir import claim_run_dir
from course.train_utils import CourseError, check_folder, check_writable, memory_bytes, number, write_manifest

BIG = "1000000000"
OVER_64_BITS = str(2**64)
UNWRITABLE = "/proc/course-probe"  # /proc takes no new file, even for root

RUN_DIR_SCRIPTS = [("train_lm", 1, []), ("train_tp", 2, []), ("train_pp", 2, []), ("train_2d", 4, []),
                   ("tp_by_hand", 2, []), ("tp_costs", 2, []), ("pp_by_hand", 2, []), ("pp_schedules", 2, []),
                   ("dcp_reshape", 4, ["--save", "{ckpt}"]), ("hsdp_bytes", 4, []), ("mesh_basics", 4, []),
                   ("moe_layer", 2, []), ("shard_memory", 2, []), ("fsdp_checkpoint", 1, ["{dcp}"]),
                   ("train_fsdp", 2, []), ("train_ddp", 2, []), ("train_flowers", 2, ["--image-size", "16"])]

# (script, world size (None: not under torchrun), arguments, words the one error line must hold)
CASES = [
    *[(s, w, [*a, "--run-dir", "{file}"], ["{file}", "is a file"]) for s, w, a in RUN_DIR_SCRIPTS],
    ("train_lm", 1, ["--run-dir", f"{UNWRITABLE}/run"], ["--run-dir", "cannot write"]),
    ("train_fsdp", 2, ["--run-dir", f"{UNWRITABLE}/run"], ["cannot write", UNWRITABLE]),
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
    ("train_fsdp", 2, ["--lr", "nan"], ["--lr", "finite"]),
    ("train_lm", 1, ["--seed", OVER_64_BITS], ["--seed", "<="]),
    ("train_2d", 4, ["--seed", OVER_64_BITS], ["--seed", "<="]),
    *[(s, w, ["--seed", OVER_64_BITS], ["--seed", "<="]) for s, w in (("train_single", 1), ("train_ddp", 2),
                                                                  ("train_fsdp", 2), ("train_flowers", 2))],
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
