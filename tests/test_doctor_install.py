"""The take-home command (issue 41 item 5, issue 53): the doctor's own wheel (``make doctor-wheel``: the ddp_doctor
package alone), installed into a fresh venv that holds nothing else but what the wheel declares (torch with
torch's own requirements; no psutil: the runner reads the process table itself), gives ``ddp-doctor``; run from a
learner's folder that holds a ``course`` package of its own (as the take-home scripts have), on a script written
for CUDA and NCCL, it names the mistake and passes the fixed version, and the files the script wrote are in
``runs/doctor/...`` of that folder, where the report says. ``course`` is not in that venv, and no module of
``ddp_doctor`` imports it. Jupyter, torchvision and TensorBoard are not there.

torch is not downloaded again: the venv sees the course venv's copies of exactly the declared distributions through
a folder of symlinks named in a ``.pth`` file; the wheel is installed with ``pip --no-deps --no-index``."""

import ast
import email
import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from course import ROOT, SCRIPTS
from course.doctor_wheel import build

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement

SCRIPT = '''
import argparse
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from course import SEED  # the learner's own package beside the script, as the take-home scripts have

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true")
args = parser.parse_args()
local_rank = int(os.environ["LOCAL_RANK"])  # written for one GPU per process, as most public scripts are
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
g = torch.Generator().manual_seed(SEED)
x = torch.randn(256, 8, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True))
sampler = DistributedSampler(data) if args.fixed else None
loader = DataLoader(data, batch_size=16, sampler=sampler, shuffle=sampler is None)
model = DDP(nn.Linear(8, 1).to(local_rank), device_ids=[local_rank])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(local_rank)), y.to(local_rank)).backward()
    opt.step()
if dist.get_rank() == 0:
    torch.save(model.module.state_dict(), "model.pt")
dist.destroy_process_group()
'''


def test_no_module_of_the_doctor_imports_the_course():
    """ddp_doctor is what goes home: it builds on nothing of ``course`` (the course builds on it)."""
    found = []
    for path in sorted((SCRIPTS / "ddp_doctor").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(SCRIPTS)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "course"]
    assert found == []


def declared(wheel: Path) -> set:
    """The distributions the wheel requires, with theirs, transitively (markers evaluated; extras not taken)."""
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
    todo, found = list(meta.get_all("Requires-Dist") or []), set()
    while todo:
        req = Requirement(todo.pop())
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # e.g. the CUDA libraries of a CPU-only torch build
        key = dist.metadata["Name"].lower()
        if key not in found:
            found.add(key)
            todo += dist.requires or []
    return found


def link_tree(names: set, folder: Path) -> None:
    """Symlinks to each distribution's top-level files and folders (and its .dist-info) in the course venv."""
    folder.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            target, link = Path(dist.locate_file(top)), folder / top
            if target.exists() and not link.exists():
                link.symlink_to(target)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    work = tmp_path_factory.mktemp("ddp-doctor-install")
    wheel = build(work / "wheel")  # what `make doctor-wheel` builds, from a copy (the checkout stays as it is)
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
    assert tops == {"ddp_doctor", next(t for t in tops if t.endswith(".dist-info"))}, tops  # the doctor alone
    env_dir = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "-q", str(wheel)], check=True, timeout=300, capture_output=True)
    names = declared(wheel)
    link_tree(names, work / "deps")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(purelib) / "course-deps.pth").write_text(str(work / "deps") + "\n")
    return env_dir, names, work


def clean_env() -> dict:
    """The environment a learner's shell would have: nothing pointing into the course venv or the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith(("COURSE_", "TORCHELASTIC_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT)) and p != sysconfig.get_path("scripts"))
    return env


def learner(command: list, **kw) -> subprocess.CompletedProcess:
    """A command run as from a learner's shell (its exit status is the test's to check)."""
    return subprocess.run(command, check=False, capture_output=True, text=True, env=clean_env(), **kw)


def test_the_venv_holds_torch_and_the_doctor_only(venv, tmp_path):
    env_dir, names, _ = venv
    assert "torch" in names and not names & {"psutil", "jupyter", "torchvision", "tensorboard", "numpy",
                                             "ipython"}, names
    python = str(env_dir / "bin" / "python")
    ok = learner([python, "-c", "import torch, ddp_doctor.doctor; print(torch.__version__)"], cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    for module in ("course", "psutil", "jupyter", "torchvision", "tensorboard"):
        missing = learner([python, "-c", f"import {module}"], cwd=tmp_path, timeout=60)
        assert missing.returncode == 1 and "ModuleNotFoundError" in missing.stderr, (module, missing.stderr)


def test_ddp_doctor_checks_a_cuda_script_beside_a_course_package(venv, tmp_path):
    """From a learner's folder with a `course` package of its own, a script written for CUDA and NCCL: the mistake
    (exit 1), the fix (exit 0); what the script wrote is in runs/doctor/... of that folder, where the report says."""
    env_dir, _, _ = venv
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "__init__.py").write_text("SEED = 0\n")
    (tmp_path / "train.py").write_text(SCRIPT)
    usage = learner([str(env_dir / "bin" / "python"), "-m", "ddp_doctor", "--help"], cwd=tmp_path, timeout=120)
    assert usage.returncode == 0 and "python -m ddp_doctor" in usage.stdout, usage.stdout + usage.stderr
    command = [str(env_dir / "bin" / "ddp-doctor"), "--steps", "4", "--timeout", "150", "train.py"]
    runs = {}
    for name, extra in (("mistake", []), ("fixed", ["--fixed"])):
        runs[name] = learner(command + extra, cwd=tmp_path, timeout=240)
    mistake, fixed = runs["mistake"], runs["fixed"]
    assert mistake.returncode == 1 and "[not-sharded]" in mistake.stdout, mistake.stdout + mistake.stderr
    assert fixed.returncode == 0 and not any(line.startswith("mistake [") for line in fixed.stdout.splitlines()), \
        fixed.stdout + fixed.stderr
    assert "Traceback" not in mistake.stderr + fixed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["course", "runs", "train.py"]  # model.pt was moved
    [folder] = (tmp_path / "runs" / "doctor").iterdir()
    assert folder.name.startswith("train-") and (folder / "files" / "model.pt").is_file(), list(folder.rglob("*"))
    for out in (mistake, fixed):
        assert f"1 new file(s) moved to {Path('runs', 'doctor', folder.name, 'files')}" in out.stdout, out.stdout
