"""Setup files agree with each other, and scripts use no deprecated or wrong API; notebook 00's run prints one
figure per message size."""

import re

import pytest
from conftest import executed_notebook

from course import ROOT, SCRIPTS


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        match = re.match(r"^\s*-?\s*([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def test_environment_yml_pins_match_requirements():
    requirements = pins((ROOT / "requirements.txt").read_text().splitlines())
    yml = (ROOT / "environment.yml").read_text()
    pip_section = yml.split("- pip:", 1)[1].splitlines()
    assert requirements and pins(pip_section) == requirements
    assert re.search(r"^\s*- python=3\.11\s*$", yml, re.MULTILINE)
    assert requirements["torch"] == "2.14.1" and requirements["torchvision"] == "0.29.1"


def test_every_requirement_is_pinned():
    for name in ("requirements.txt", "requirements-test.txt"):
        for line in (ROOT / name).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                assert "==" in line, f"{name}: unpinned: {line}"


def test_test_tools_stay_out_of_the_course_install():
    """requirements-test.txt is `make test`'s alone: in neither requirements.txt nor environment.yml."""
    tools = pins((ROOT / "requirements-test.txt").read_text().splitlines())
    assert {"pytest", "ruff", "playwright"} <= set(tools)
    assert not set(tools) & set(pins((ROOT / "environment.yml").read_text().splitlines()))
    assert not set(tools) & set(pins((ROOT / "requirements.txt").read_text().splitlines()))


DEPRECATED_OR_WRONG = {
    r"torch\.distributed\.launch\b": "deprecated launcher: use torchrun",
    r"torch\.cuda\.amp": "deprecated: use torch.amp",
    r"type\s*=\s*bool": "argparse type=bool cannot be switched off",
    r"\brank\s*=\s*int\(os\.environ\[.LOCAL_RANK.\]\)": "LOCAL_RANK used as the global rank",
}
HARD_CODED = {r"\.cuda\(\)": "hard-coded CUDA device", r"backend\s*=\s*['\"]nccl['\"]": "hard-coded nccl"}


def test_scripts_use_no_deprecated_or_wrong_api():
    checked = 0
    for path in [*SCRIPTS.glob("*.py"), *(SCRIPTS / "course").glob("*.py")]:
        if path.name.startswith("pitfall_"):
            continue  # pitfall scripts reproduce mistakes on purpose, behind a flag; notebook 04 tests them
        rules = {**DEPRECATED_OR_WRONG, **(HARD_CODED if path.parent == SCRIPTS else {})}
        text = path.read_text()
        checked += 1
        for pattern, why in rules.items():
            assert not re.search(pattern, text), f"{path.name}: {why}"
    assert checked >= 5


def test_machine_report_says_what_each_backend_can_do_here():
    from course.machine_report import report_lines

    cpu = dict(report_lines({"torch": "2.14.1", "cpu_cores": 2, "accelerator": None, "accelerator_count": 0,
                             "device_names": [], "gloo": True, "nccl_built": True, "nccl_usable": False,
                             "2 ranks use": "gloo on cpu"}))
    assert cpu["accelerator"].startswith("none") and cpu["nccl"].endswith("usable only with GPUs (none here)")
    assert cpu["gloo"].startswith("available") and cpu["2 ranks use"] == "gloo on cpu"  # other fields kept
    gpus = dict(report_lines({"accelerator": "cuda", "accelerator_count": 2, "device_names": ["H100", "H100"],
                              "gloo": True, "nccl_built": True, "nccl_usable": True}))
    assert gpus["accelerator"] == "cuda × 2 (H100, H100)" and gpus["nccl"] == "available, and usable here: 2 GPU(s)"
    assert dict(report_lines({"nccl_built": False}))["nccl"] == "not in this build of PyTorch"


def test_notebook_00_prints_one_bus_bandwidth_per_size_and_no_prediction_it_did_not_see():
    """Issue 52, read from notebook 00's headless run (conftest.executed_notebook, shared with test_notebooks):
    - the largest message had two bus bandwidths (its line, and a second measurement beside the local copy): the
      copy is now timed in the same rounds, so the table's all_reduce row is that line's rounds;
    - a Check yourself answered from the key says so, never "as you predicted";
    - the inline TensorBoard leaves its frame and one line, no ``TensorBoardInfo(...)`` repr."""
    import statistics

    import nbformat

    from course.hello import _size

    run = executed_notebook("00_environment").require_ok()
    metrics = run.metrics("np2")
    ring = 2 * (metrics["world_size"] - 1) / metrics["world_size"]
    largest = max(int(k) for k in metrics["time_ms_by_KiB"])
    per_round = [ring * largest * 1024 / (ms / 1e3) / 1e9 for ms in metrics["time_ms_by_KiB"][str(largest)]]
    compared = metrics["comparison"]["values"]["all_reduce (bus bandwidth)"]
    assert compared == pytest.approx(per_round, rel=1e-9) and metrics["compared_MiB"] * 1024 == largest
    assert metrics["bus_bandwidth_GBps_by_KiB"][str(largest)] == round(statistics.median(per_round), 3)
    printed = run.output()
    line = re.search(rf"all_reduce +{largest} KiB: .*bus bandwidth +(\S+) GB/s", printed)
    row = re.search(r"all_reduce \(bus bandwidth\) +(\S+) \(", printed)
    assert line and row and line[1] == row[1], (line and line[0], row and row[0])  # one figure, printed alike
    assert f"{_size(largest)}: the all_reduce line above" in printed
    passes = [text for text in printed.splitlines() if text.startswith("PASS")]
    assert len(passes) == 2 and all(text.endswith("(answered from the key: COURSE_ANSWER_KEY=1)") for text in passes)
    assert "predicted" not in printed
    cells = nbformat.read(run.executed, as_version=4).cells
    board = next(c for c in cells if c.cell_type == "code" and "show(" in c.source and "inline_tensorboard" in c.source)
    kinds = [(o.output_type, "".join(o.get("text", "")).count("\n")) for o in board.outputs]
    assert kinds == [("display_data", 0), ("stream", 1)], board.outputs
    assert "TensorBoardInfo" not in str(board.outputs)
