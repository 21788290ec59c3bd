"""The doctor's public-shape set (tests/fixtures/doctor_public/): scripts in the shapes of widely copied public DDP
code, at least 10 with a mistake (a rewritten published file's own) and a fixed version; a few of them run through the doctor
here (a CUDA/NCCL script launched by torchrun, an mp.spawn script, a fixed one), on a CPU machine through the CPU
stand-in. The whole set is the benchmark's (course.bench_doctor_public, make bench)."""

import pytest
from conftest import wait_for_no_processes

from course import ROOT
from course import doctor_cases as cases
from ddp_doctor.report import COST

CASES = cases.load(ROOT / "tests" / "fixtures" / "doctor_public" / "cases.json")
# article-train-multi-gpu: the source article's published script as published (its torch.cuda guard, SyncBN, helper
# modules, DataLoaders with worker processes), with its two mistakes (fixed: the benchmark's)
# imagenet-main-dual-mode: both launch styles in one script, its arguments choosing torchrun's; its GPU path
# ts-multigpu-torchrun: the DDP tutorial series' torchrun script as published (no set_epoch)
# org-ddp-tutorial-published: the pytorch.org DDP tutorial's mp.spawn example, three worlds spawned one after another
LAUNCHED = ["ts-multigpu-torchrun", "org-ddp-tutorial-published", "torchvision-reference-fixed",
            "article-train-multi-gpu", "imagenet-main-dual-mode"]


def test_the_set_has_ten_shapes_each_mistaken_and_fixed():
    """Each script once as it is (a rewritten published file: as published) and once fixed; a published file without
    a data-parallel mistake is one clean case (the doctor must not invent one); at least 10 shapes with a mistake."""
    scripts = {c.script for c in CASES}
    assert len(scripts) >= 10 and all(s.is_file() for s in scripts)
    folder = ROOT / "tests" / "fixtures" / "doctor_public"
    for script in scripts:
        mine = [c for c in CASES if c.script == script]
        mistaken = [c for c in mine if c.expect]
        fixed = [c for c in mine if not c.expect]
        published = script.parent != folder  # rewritten from a published file, in a folder of its own
        assert len(mistaken) == 1 or (published and not mistaken), script.name  # its mistakes (a published file's)
        assert len(fixed) == 1 and fixed[0].group == "correct", script.name
        # a script rewritten from a published one keeps its helper modules beside it, in a folder of its own
        own = published
        source = "".join(p.read_text() for p in (script.parent.rglob("*.py") if own else [script]))
        assert "nccl" in source and "cuda" in source.lower(), f"{script.name}: written as its authors would, for CUDA"
    assert sum("mp.spawn(" in s.read_text() for s in scripts) >= 2
    assert len({c.script for c in CASES if c.expect}) >= 10
    # the source article's script as published: its GPU guard and its helper modules (--local_rank, which its older
    # version took, is the runner's test: tests/test_doctor_runner.py)
    article = ROOT / "tests" / "fixtures" / "doctor_public" / "article"
    assert "if torch.cuda.is_available() is False:" in (article / "train_multi_gpu_using_launch.py").read_text()
    assert {"multi_train_utils/distributed_utils.py", "multi_train_utils/train_eval_utils.py", "utils.py"} <= \
        {str(p.relative_to(article)) for p in article.rglob("*.py")}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return cases.run_all([c for c in CASES if c.name in LAUNCHED], tmp_path_factory.mktemp("doctor-public"))


@pytest.mark.parametrize("name", LAUNCHED)
def test_the_doctor_checks_a_public_shape_on_this_machine(name, outcomes):
    outcome = outcomes[name]
    report = outcome.report
    assert outcome.found == sorted(outcome.case.expect), report.text()
    mistakes = [f for f in report.findings if f.kind != COST]
    assert report.status == (1 if mistakes else 0) and not report.error, report.text()
    if "stand-in" in report.command:  # a CPU machine: the report says so, and what it could not see
        assert any("what needs a GPU" in u for u in report.unchecked), report.text()
    assert wait_for_no_processes(outcome.case.script.name, timeout=10) == []
    if name.startswith("article-train-multi-gpu"):  # issue 54 item 6: initial weights handed through the temp folder
        assert any(u.startswith("a file handed between ranks outside the working folder: rank 0 wrote ") and
                   "initial_weights.pt and rank 1 read it" in u for u in report.unchecked), report.text()
    if name == "article-train-multi-gpu":  # the published file's own mistakes, with their evidence
        evidence = {f.code: f.evidence for f in report.findings}
        assert "class_indices.json" in evidence["rank-writes"] and "padded to" in evidence["eval-padding"], evidence
    if name == "org-ddp-tutorial-published":  # each world's ranks recorded apart: the first checked, the rest said
        assert "the processes of the script's later mp.spawn calls (2)" in report.unchecked, report.text()
        assert any(c.startswith("replicas (1 fingerprints") for c in report.checked), report.text()
    if name == "imagenet-main-dual-mode":  # issue 54 item 3: the launch style from the first try, said with why
        assert "run under torchrun: started once as `python script`, it stopped at `KeyError: 'WORLD_SIZE'`" \
            in report.command and "telling the script it has 1 GPU per node" in report.command, report.command


def test_the_benchmarks_plain_run_gets_the_exit_race_wait_and_the_stand_in(tmp_path):
    """make bench's plain baseline of two fixed scripts failed now and then (gloo's exit race after the script's last
    line: 'terminate called without an active exception'), which the doctor's own runs are spared by the course
    launcher's start-up pause; the plain run now starts with the same pause, and its sitecustomize runs the
    stand-in's after it (a process started in that environment has both; nothing is launched)."""
    import subprocess
    import sys

    from course.bench_doctor_public import plain_env
    from ddp_doctor.runner.run import STARTUP

    env = plain_env(tmp_path, {"standin": True, "pretend": True})
    probe = ("import sys, sitecustomize, torch.distributed; print(sitecustomize.__file__); "
             "print('recorder_standin' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    first, standin = done.stdout.split()
    assert first == str(STARTUP / "sitecustomize.py") and standin == "True", done.stdout + done.stderr
    assert "Error in sitecustomize" not in done.stderr, done.stderr
