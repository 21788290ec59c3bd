"""Setup files agree with each other, and scripts use no deprecated or wrong API."""

import re

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
