"""The laptop-sized install (issue 36): requirements.txt runs the course, requirements-test.txt adds the test tools
for `make test` only, and `make setup TORCH=cpu` takes PyTorch's CPU-only build, or says in one line, within
seconds, that its index cannot be reached. The Makefile is read with `make -n` (nothing runs) and the setup
script runs against indexes on this machine (a closed port, an unresolvable name, a local server)."""

import ast
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from test_environment import pins as pinned_in

from course import ROOT, SCRIPTS, setup_torch
from course.launcher import free_port

SETUP_TORCH = SCRIPTS / "course" / "setup_torch.py"


def pins(name: str) -> dict[str, str]:
    return pinned_in((ROOT / name).read_text().splitlines())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_closure(names) -> set[str]:
    """The distributions ``names`` pull in, as installed here (their own extras left out)."""
    seen, todo = set(), [_norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen


def imported_modules() -> dict[str, str]:
    """Top-level module -> first file importing it, over scripts/ and the notebooks' code cells (cell magics
    such as %%writefile are skipped: what they write is in scripts/ already)."""
    found: dict[str, str] = {}

    def add(source: str, where: str):
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                found.setdefault(name.split(".")[0], where)

    for path in SCRIPTS.rglob("*.py"):
        add(path.read_text(), str(path.relative_to(ROOT)))
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and not source.lstrip().startswith("%%"):
                add("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))),
                    notebook.name)
    return found


def test_the_course_runs_on_requirements_txt_and_never_imports_a_test_tool():
    runtime, tests = pins("requirements.txt"), pins("requirements-test.txt")
    assert {"pytest", "pytest-timeout", "playwright", "ruff"} <= set(tests) and not set(tests) & set(runtime)
    needed = installed_closure(runtime)
    local = {"course", "ddp_doctor"} | {p.stem for p in SCRIPTS.rglob("*.py")}
    providers = metadata.packages_distributions()
    checked = 0
    for module, where in sorted(imported_modules().items()):
        if module in sys.stdlib_module_names or module in local:
            continue
        dists = {_norm(d) for d in providers.get(module, [module])}
        assert dists & needed, f"{where} imports {module} ({', '.join(dists)}), which requirements.txt does not install"
        assert not dists & {_norm(t) for t in tests} - needed, f"{where} imports the test tool {module}"
        checked += 1
    assert checked >= 10  # torch, torchvision, numpy, ... are found at all


def make_dry_run(*targets: str, tmp_path: Path, **variables: str) -> list[str]:
    """The recipe lines `make` would run for ``targets`` with a venv that does not exist yet (``make -n``)."""
    if not shutil.which("make"):
        pytest.skip("make is not installed here")
    args = [f"{k}={v}" for k, v in {"VENV": str(tmp_path / "venv"), **variables}.items()]
    out = subprocess.run(["make", "-n", "-C", str(ROOT), *targets, *args], capture_output=True, text=True,
                         timeout=60, check=True)
    return [line for line in out.stdout.splitlines() if not line.startswith("make")]


@pytest.mark.parametrize("target", ["course", "lab", "setup"])
def test_make_course_and_lab_install_no_test_tools(target, tmp_path):
    lines = make_dry_run(target, tmp_path=tmp_path)
    assert any("-r requirements.txt" in line for line in lines), lines
    assert not any("requirements-test.txt" in line for line in lines), lines


def test_make_test_adds_the_test_tools_with_a_stamp_of_their_own(tmp_path):
    lines = make_dry_run("test", tmp_path=tmp_path)
    order = [i for i, line in enumerate(lines) for f in ("-r requirements.txt", "-r requirements-test.txt")
             if f in line]
    assert len(order) == 2 and order == sorted(order), lines  # the course's pins first, then the test tools
    assert f"touch {tmp_path / 'venv'}/.installed-test" in lines and f"touch {tmp_path / 'venv'}/.installed" in lines
    # after `make course` (its stamp present and newer than the pins), `make test` installs only the test tools
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()
    lines = make_dry_run("test", tmp_path=tmp_path)
    assert not any("-r requirements.txt" in line for line in lines), lines
    assert any("-r requirements-test.txt" in line for line in lines), lines


def test_make_setup_passes_the_torch_choice_before_the_requirements(tmp_path):
    lines = make_dry_run("setup", tmp_path=tmp_path, TORCH="cpu", TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu")
    torch_line = next(i for i, line in enumerate(lines) if "setup_torch.py" in line)
    assert "--torch cpu --index http://127.0.0.1:9/whl/cpu" in lines[torch_line]
    assert torch_line < next(i for i, line in enumerate(lines) if "-r requirements.txt" in line)
    default = make_dry_run("setup", tmp_path=tmp_path)
    assert any("--torch default --index https://download.pytorch.org/whl/cpu" in line for line in default)


def run_setup_torch(*args: str, timeout: float = 60):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-I", str(SETUP_TORCH), *args], capture_output=True, text=True,
                         timeout=timeout, check=False)
    return out, time.monotonic() - start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TORCH=cpu acts on Linux only")
@pytest.mark.parametrize("index", ["closed port", "http://cpu-index.invalid/whl/cpu"])
def test_unreachable_cpu_index_is_one_line_within_seconds(index):
    if index == "closed port":
        index = f"http://127.0.0.1:{free_port()}/whl/cpu"  # nothing listens there: refused at once
    out, seconds = run_setup_torch("--torch", "cpu", "--index", index)  # no --dry-run: it must not reach pip
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"make setup: PyTorch's CPU index {index} cannot be reached (")
    assert lines[0].endswith("installing the default build from PyPI instead")
    assert seconds < setup_torch.PROBE_SECONDS + 10, seconds  # the probe's own cap, plus Python's start-up


def test_a_hanging_index_is_given_up_after_the_probe_time():
    """A server that accepts the connection and never answers (as a broken resolver or proxy would)."""
    with __import__("socket").create_server(("127.0.0.1", 0)) as server:
        start = time.monotonic()
        why = setup_torch.unreachable(f"http://127.0.0.1:{server.getsockname()[1]}/whl/cpu", seconds=1.0)
        assert why is not None and time.monotonic() - start < 3


class _Index(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TORCH=cpu acts on Linux only")
def test_reachable_cpu_index_installs_the_pinned_cpu_wheels(tmp_path):
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<a>torch-2.14.1+cpu</a>")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: _Index(*a, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        out, _ = run_setup_torch("--torch", "cpu", "--index", index, "--dry-run")
    finally:
        server.shutdown()
    command = out.stdout.splitlines()[-1]
    want = pins("requirements.txt")
    assert out.returncode == 0 and "cannot be reached" not in out.stdout, out.stdout + out.stderr
    assert command.endswith(f"-m pip install --quiet --disable-pip-version-check --index-url {index} "
                            f"torch=={want['torch']}+cpu torchvision=={want['torchvision']}+cpu"), command


def test_default_build_and_other_platforms_need_nothing(capsys):
    assert setup_torch.main(["--torch", "default"]) == 0 and capsys.readouterr().out == ""
    for platform in ("darwin", "win32"):
        assert setup_torch.main(["--torch", "cpu", "--index", "http://127.0.0.1:9/x"], platform=platform) == 0
        assert capsys.readouterr().out.count("\n") == 1  # one line, and no probe of the index


def test_cpu_pins_are_those_of_requirements_txt():
    assert setup_torch.pinned() == {k: v for k, v in pins("requirements.txt").items() if k in ("torch", "torchvision")}


def _wheel(folder: Path, name: str, version: str, requires: str = "") -> None:
    """A minimal pure-Python wheel standing in for PyTorch's (only its name and version matter here)."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    (folder / name).mkdir(parents=True)
    with zipfile.ZipFile(folder / name / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TORCH=cpu acts on Linux only")
def test_cpu_wheels_installed_from_an_index_satisfy_requirements_txt(tmp_path):
    """The whole path in a throwaway venv, against a local index holding stand-ins for the +cpu wheels: setup installs
    them, and afterwards requirements.txt's `torch==2.14.1` is already satisfied (a local label such as +cpu is
    ignored by a pin without one), so `pip install -r requirements.txt` downloads no second PyTorch."""
    want = pins("requirements.txt")
    index = tmp_path / "index"
    _wheel(index, "torch", f"{want['torch']}+cpu")
    _wheel(index, "torchvision", f"{want['torchvision']}+cpu", f"Requires-Dist: torch=={want['torch']}\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: _Index(*a, directory=str(index)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    venv = tmp_path / "venv"
    env = {"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null", "PIP_NO_INPUT": "1", "HOME": str(tmp_path)}
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=env)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = subprocess.run([venv / "bin" / "python", "-I", SETUP_TORCH, "--torch", "cpu", "--index", url],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
    finally:
        server.shutdown()
    said = f"make setup: PyTorch {want['torch']}, CPU-only build, from {url}\n"
    assert out.returncode == 0 and out.stdout == said, out.stdout + out.stderr
    show = "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
    versions = subprocess.run([venv / "bin" / "python", "-c", show], capture_output=True, text=True, timeout=60,
                              env=env, check=True).stdout.split()
    assert versions == [f"{want['torch']}+cpu", f"{want['torchvision']}+cpu"]
    again = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--no-index", "--dry-run",
                            f"torch=={want['torch']}", f"torchvision=={want['torchvision']}"],
                           capture_output=True, text=True, timeout=120, env=env, check=False)
    assert again.returncode == 0 and again.stdout.count("Requirement already satisfied") == 2, again.stdout + again.stderr
