"""``make doctor-wheel``: the DDP doctor as a wheel of its own (``ddp_doctor`` alone, torch its only requirement),
built from a copy of scripts/ddp_doctor (its project file, ``pyproject.toml``, is in that folder), so that the
checkout stays as it is.

    python -m course.doctor_wheel build/dist      # writes build/dist/ddp_doctor-<version>-py3-none-any.whl
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from course import SCRIPTS


def build(out: Path) -> Path:
    """Build the wheel into ``out`` (created); returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-wheel-") as work:
        src = Path(work) / "ddp_doctor"
        shutil.copytree(SCRIPTS / "ddp_doctor", src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "build",
                                                                                   "*.egg-info"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                       check=True, timeout=300, capture_output=True)
    return max(out.glob("ddp_doctor-*.whl"), key=lambda w: w.stat().st_mtime)


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "build/dist")))
