"""`make setup TORCH=cpu`: put PyTorch's CPU-only build into the venv, or say in one line why it does not.

    python -I scripts/course/setup_torch.py --torch cpu [--index URL] [--dry-run]

It runs before the course is installed, so it uses the standard library only (and ``-I`` keeps this folder
off ``sys.path``). Then ``pip install -r requirements.txt`` runs as always: ``torch==2.14.1`` is satisfied
by ``2.14.1+cpu`` (a local version label is ignored when the pin has none), so nothing is downloaded twice.

- ``--torch default``: does nothing; requirements.txt installs PyPI's wheel (on Linux, the CUDA build).
- ``--torch cpu`` on Linux: one quick look at the CPU index (a single request, at most ``PROBE_SECONDS``,
  DNS included, no retry). Unreachable: one line, exit 0, and the default build follows. Reachable:
  ``pip install torch==X+cpu torchvision==Y+cpu --index-url INDEX``, the versions read from requirements.txt
  (the ``+cpu`` pins also replace a CUDA build already in the venv).
- ``--torch cpu`` on macOS or Windows: one line; PyPI's wheels for them carry no CUDA libraries already.
"""

import argparse
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's own index of CPU-only wheels
PROBE_SECONDS = 5.0
REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"
SAY = "make setup:"


def pinned(requirements: Path = REQUIREMENTS) -> dict[str, str]:
    """``{"torch": "2.14.1", "torchvision": "0.29.1"}`` as pinned in requirements.txt."""
    pins = dict(re.findall(r"^(torch|torchvision)==([^\s#]+)", requirements.read_text(), re.MULTILINE))
    if set(pins) != {"torch", "torchvision"}:
        raise SystemExit(f"{SAY} requirements.txt must pin torch and torchvision (found {pins})")
    return pins


def unreachable(index: str, seconds: float = PROBE_SECONDS) -> str | None:
    """Why ``index`` cannot be reached (one short phrase), or None if it answers.

    The request runs in a daemon thread that is abandoned after ``seconds``: a socket timeout does not cover
    name resolution, which can hang far longer than that on a machine with a broken resolver."""
    outcome: list = []

    def probe():
        try:
            with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=seconds):
                outcome.append(None)
        except urllib.error.HTTPError as exc:  # it answers, but not as a package index
            outcome.append(f"HTTP {exc.code} {exc.reason}")
        except Exception as exc:  # noqa: BLE001 - every failure means "not reachable"; its reason is shown
            reason = getattr(exc, "reason", None) or exc
            outcome.append(str(reason).strip() or type(exc).__name__)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else f"no answer within {seconds:g} s"


def nvidia_gpu() -> str | None:
    """The first NVIDIA device node on this Linux machine (``/dev/nvidia0``), or None."""
    return next((str(p) for p in sorted(Path("/dev").glob("nvidia[0-9]*"))), None)


def pip_command(index: str, pins: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--index-url", index,
            f"torch=={pins['torch']}+cpu", f"torchvision=={pins['torchvision']}+cpu"]


def main(argv=None, platform: str = sys.platform) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", choices=["default", "cpu"], default="default", help="which PyTorch build")
    parser.add_argument("--index", default=CPU_INDEX, help="PyTorch's CPU index (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    args = parser.parse_args(argv)
    if args.torch == "default":
        return 0
    if not platform.startswith("linux"):
        print(f"{SAY} TORCH=cpu changes nothing on {platform}: PyPI's PyTorch wheel there has no CUDA libraries")
        return 0
    pins = pinned()
    why = unreachable(args.index)
    if why is not None:
        print(f"{SAY} PyTorch's CPU index {args.index} cannot be reached ({why}); "
              f"installing the default build from PyPI instead", flush=True)
        return 0
    gpu = nvidia_gpu()
    if gpu:
        print(f"{SAY} note: this machine has an NVIDIA GPU ({gpu}); the CPU-only build will not use it")
    command = pip_command(args.index, pins)
    if args.dry_run:
        print(" ".join(command))
        return 0
    print(f"{SAY} PyTorch {pins['torch']}, CPU-only build, from {args.index}", flush=True)
    code = subprocess.call(command)
    if code:
        print(f"{SAY} pip could not install the CPU-only build (exit {code}, its messages above); "
              f"installing the default build from PyPI instead", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
