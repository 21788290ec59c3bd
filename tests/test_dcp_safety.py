"""Issue 51 #5: nothing runs from a checkpoint. DCP unpickles every item of a state dict that is not a tensor
(an int, the optimizer's param_groups, any object) with ``torch.load(..., weights_only=False)``; a folder whose
``epoch`` is an object that runs code when unpickled is refused by ``course.dcp_check.problem`` in one line, with or
without its sha256.json (which a tamperer rewrites), before any process group; and ``WeightsOnlyPlanner``, the
planner of every ``dcp.load`` in the course, refuses it inside ``dcp.load`` too, when the check is bypassed (a folder
changed after it). The proof that nothing ran: unpickling the item would create a file. One process, no process
group (DCP saves and loads without one): a few seconds in all.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_model_parallel_args import no_process_group, run_main  # noqa: F401 (a fixture)

from course import ROOT, SCRIPTS
from course.dcp_check import (
    MANIFEST,
    WeightsOnlyPlanner,
    dcp_to_torch_save,
    load_failure,
    problem,
    write_manifest,
)


class _Evil:
    """The issue's reproduction, with a side effect to look for: unpickling it creates the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_folder(tmp_path, manifest: bool):
    """A DCP folder whose "epoch" runs code when unpickled; with a sha256.json that matches it, or none."""
    folder, ran = tmp_path / "evil", tmp_path / "ran"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.zeros(3), "epoch": _Evil(ran)}, checkpoint_id=str(folder))
    if manifest:
        write_manifest(folder)  # whoever can replace a piece can rewrite the manifest
    assert not ran.exists()  # saving pickles it, nothing more
    return folder, ran


def _state():
    return {"w": torch.ones(3), "epoch": torch.tensor(-1)}


def _load(state, folder, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder), **kwargs)


@pytest.mark.parametrize("manifest", [True, False], ids=["with sha256.json", "without sha256.json"])
def test_an_item_that_would_run_code_is_refused_in_one_line_and_runs_nothing(manifest, tmp_path):
    folder, ran = _evil_folder(tmp_path, manifest)
    assert (folder / MANIFEST).exists() == manifest
    why = problem(folder)
    assert why is not None and "\n" not in why, why
    assert why.startswith(f"checkpoint {folder}: its item 'epoch' asks to run code (io.open)"), why
    assert "refused" in why and "weights_only" not in why
    assert not ran.exists()


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize("script, world, argv", [("fsdp_checkpoint", 1, ["{ckpt}"]),
                                                 ("dcp_reshape", 1, ["--load", "{ckpt}", "--dp", "1"])])
@pytest.mark.parametrize("manifest", [True, False], ids=["with sha256.json", "without sha256.json"])
def test_the_course_scripts_refuse_it_before_any_process_group(script, world, argv, manifest, tmp_path, monkeypatch,
                                                               capsys):
    folder, ran = _evil_folder(tmp_path, manifest)
    code, err = run_main(script, world, [a.replace("{ckpt}", str(folder)) for a in argv], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1, err
    assert "its item 'epoch' asks to run code" in lines[0] and str(folder) in lines[0], lines[0]
    assert "Traceback" not in err and not ran.exists()


def test_the_course_planner_refuses_it_inside_dcp_load_when_the_check_is_bypassed(tmp_path):
    """A folder changed after problem() passed it: dcp.load with the course's planner unpickles the item with the
    weights-only unpickler, raises, and runs nothing; so does the course's dcp_to_torch_save. DCP's own planner
    runs it: the reproduction is live, and the planner is what stops it."""
    folder, ran = _evil_folder(tmp_path, manifest=True)
    state = _state()
    with pytest.raises(dcp.CheckpointException) as raised:
        _load(state, folder, planner=WeightsOnlyPlanner())
    line = load_failure(folder, raised.value)
    assert line.startswith(f"checkpoint {folder} could not be loaded (rank 0): its item 'epoch' asks to run code"), line
    assert "\n" not in line and "weights_only" not in line
    assert not ran.exists()
    with pytest.raises(dcp.CheckpointException):
        dcp_to_torch_save(folder, tmp_path / "joined.pt")
    assert not ran.exists() and not (tmp_path / "joined.pt").exists()

    _load(_state(), folder)  # DCP's DefaultLoadPlanner: torch.load(..., weights_only=False)
    assert ran.exists(), "DCP no longer runs code from a non-tensor item: the course's planner may be dropped"


def test_the_planner_loads_plain_items_as_dcp_does(tmp_path):
    """Numbers, strings, lists, dicts and tensors, as the course's checkpoints hold them (train_fsdp.py: epoch and
    step as tensors; dcp_reshape.py: the optimizer's param_groups), load as DCP's own planner loads them."""
    folder = tmp_path / "plain"
    saved = {"w": torch.arange(6.0).reshape(2, 3), "epoch": torch.tensor(2), "step": torch.tensor(40),
             "groups": [{"lr": 0.05, "betas": (0.9, 0.999), "params": ["w"], "foreach": None, "fused": False}],
             "note": "x", "count": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(saved, checkpoint_id=str(folder))
    write_manifest(folder)
    assert problem(folder) is None

    def empty():
        return {"w": torch.zeros(2, 3), "epoch": torch.tensor(-1), "step": torch.tensor(-1),
                "groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [""], "foreach": None, "fused": True}],
                "note": "", "count": 0}

    ours, theirs = empty(), empty()
    _load(ours, folder, planner=WeightsOnlyPlanner())
    _load(theirs, folder)
    assert ours.keys() == theirs.keys() == saved.keys()
    assert torch.equal(ours["w"], saved["w"]) and int(ours["epoch"]) == 2 and int(ours["step"]) == 40
    assert ours["groups"] == theirs["groups"] == saved["groups"] and (ours["note"], ours["count"]) == ("x", 3)
    dcp_to_torch_save(folder, tmp_path / "joined.pt")
    joined = torch.load(tmp_path / "joined.pt", weights_only=True)
    assert joined["groups"] == saved["groups"] and int(joined["step"]) == 40


def test_an_older_checkpoint_with_numbers_as_pickles_still_loads_into_the_readers(tmp_path):
    """fsdp_checkpoint.py now asks for epoch and step as tensors; a folder that holds them as plain ints (saved
    before) fills them with ints, and int() reads both."""
    folder = tmp_path / "old"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(3), "epoch": 1, "step": 7}, checkpoint_id=str(folder))
    state = {"w": torch.zeros(3), "epoch": torch.tensor(-1), "step": torch.tensor(-1)}
    _load(state, folder, planner=WeightsOnlyPlanner())
    assert (int(state["epoch"]), int(state["step"])) == (1, 7)


def test_every_dcp_load_of_the_course_goes_through_the_planner():
    """Every line of a script or a notebook's code that calls dcp.load passes the course's planner, and nothing
    uses torch's format_utils (dcp_to_torch_save's planner unpickles with weights_only=False): a new load without
    it fails here."""
    sources = {str(p): p.read_text() for p in SCRIPTS.rglob("*.py")}
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        sources[str(path)] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    loads = [(where, line) for where, text in sources.items() for line in text.splitlines() if "dcp.load(" in line]
    assert {Path(where).stem for where, _ in loads} >= {"fsdp_checkpoint", "dcp_reshape", "08_sharding_fsdp",
                                                        "12_composed_parallelism"}
    assert all("planner=WeightsOnlyPlanner()" in line for _, line in loads), loads
    assert not [where for where, text in sources.items() if "format_utils import" in text]
