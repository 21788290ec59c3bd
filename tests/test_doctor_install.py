"""The take-home command (issue 41 item 5): the package, built as a wheel and installed into a fresh venv that holds
nothing else but what the wheel declares (torch with torch's own requirements; no psutil: the launcher reads
the process table itself), gives ``ddp-doctor``; run
from a learner's folder that holds a ``course`` package of its own (as the take-home scripts have), it names the
mistake of a small script and passes its fixed version. Jupyter, torchvision and TensorBoard are not there.

torch is not downloaded again: the venv sees the course venv's copies of exactly the declared distributions through
a folder of symlinks named in a ``.pth`` file; the wheel is installed with ``pip --no-deps --no-index``."""

import email
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from course import ROOT

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement

SCRIPT = '''
import argparse
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from course import SEED  # the learner's own package beside the script, as the take-home scripts have

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true")
args = parser.parse_args()
dist.init_process_group("gloo")
g = torch.Generator().manual_seed(SEED)
x = torch.randn(256, 8, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True))
sampler = DistributedSampler(data) if args.fixed else None
loader = DataLoader(data, batch_size=16, sampler=sampler, shuffle=sampler is None)
model = DDP(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
dist.destroy_process_group()
'''


def build_wheel(out: Path) -> Path:
    """The wheel `make doctor-wheel` builds, built from a copy of the package (the shared checkout stays as it is)."""
    src = out / "src"
    (src / "scripts").mkdir(parents=True)
    (src / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    shutil.copytree(ROOT / "scripts" / "course", src / "scripts" / "course",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "-q", "-w", str(out / "wheel"), str(src)],
                   check=True, timeout=300, capture_output=True)
    return next((out / "wheel").glob("ddp_course-*.whl"))


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
    wheel = build_wheel(work)
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
    return env_dir, names


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


def test_the_venv_holds_torch_and_the_package_only(venv):
    env_dir, names = venv
    assert "torch" in names and not names & {"psutil", "jupyter", "torchvision", "tensorboard", "numpy",
                                             "ipython"}, names
    python = str(env_dir / "bin" / "python")
    ok = learner([python, "-c", "import torch, course.doctor; print(torch.__version__)"], timeout=120)
    assert ok.returncode == 0, ok.stderr
    for module in ("psutil", "jupyter", "torchvision", "tensorboard"):
        missing = learner([python, "-c", f"import {module}"], timeout=60)
        assert missing.returncode == 1 and "ModuleNotFoundError" in missing.stderr, (module, missing.stderr)


def test_ddp_doctor_names_the_mistake_and_passes_the_fix(venv, tmp_path):
    """From a learner's folder with a `course` package of its own: the mistake (exit 1), the fix (exit 0)."""
    env_dir, _ = venv
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "__init__.py").write_text("SEED = 0\n")
    (tmp_path / "train.py").write_text(SCRIPT)
    command = [str(env_dir / "bin" / "ddp-doctor"), "--steps", "4", "--timeout", "150", "train.py"]
    runs = {}
    for name, extra in (("mistake", []), ("fixed", ["--fixed"])):
        runs[name] = learner(command + extra, cwd=tmp_path, timeout=240)
    mistake, fixed = runs["mistake"], runs["fixed"]
    assert mistake.returncode == 1 and "[not-sharded]" in mistake.stdout, mistake.stdout + mistake.stderr
    assert fixed.returncode == 0 and not any(line.startswith("mistake [") for line in fixed.stdout.splitlines()), \
        fixed.stdout + fixed.stderr
    assert "Traceback" not in mistake.stderr + fixed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["course", "train.py"]  # nothing left in the folder
