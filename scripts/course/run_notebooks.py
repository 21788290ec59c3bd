"""Execute the course's notebooks in order, headless, and print a summary.

    python -m course.run_notebooks                 # every notebooks/*.ipynb
    python -m course.run_notebooks 00 03           # those whose name starts so
    COURSE_QUICK=1 python -m course.run_notebooks  # the quick course
    ... --record-times                             # and store the times in notebooks/times.json (course.times)

Executed copies go to build/notebooks/ (git-ignored), signed so that JupyterLab trusts them and
renders their inline TensorBoard. The summary's figures are read from the metrics.json files
that the notebook's runs wrote.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.sign import NotebookNotary

from course import QUICK, ROOT, RUNS

NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "build" / "notebooks"
_SIGNING = threading.Lock()  # the signature store is one sqlite file: one writer at a time (tests run two notebooks)


def execute(path: Path, out_dir: Path = EXECUTED, cell_timeout: int = 1200) -> tuple[bool, float, str]:
    """Run one notebook in a fresh kernel with notebooks/ as working directory; save the executed copy."""
    nb = nbformat.read(path, as_version=4)
    # IPC sockets in a private folder: the kernel is reachable by this user only (no TCP port, so no
    # "Kernel is running over TCP without encryption" warning for every notebook).
    sockets = tempfile.mkdtemp(prefix="course-kernel-")
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
    client = NotebookClient(nb, km=km, timeout=cell_timeout, resources={"metadata": {"path": str(path.parent)}})
    start = time.monotonic()
    error = ""
    try:
        client.execute()
    except CellExecutionError as exc:  # nbclient stops at the first cell that raises
        error = str(exc)
    finally:
        if km.has_kernel:  # we own this kernel manager, so we end the kernel
            km.shutdown_kernel(now=False)
        shutil.rmtree(sockets, ignore_errors=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        with _SIGNING:
            NotebookNotary().sign(nb)  # trusted: Lab will render the TensorBoard iframe and widgets
        nbformat.write(nb, out_dir / path.name)
    return not error, time.monotonic() - start, error


def runs_written_since(t0: float) -> list[tuple[str, dict]]:
    found = []
    for f in sorted(RUNS.rglob("metrics.json")):
        if f.stat().st_mtime >= t0:
            found.append((str(f.parent.relative_to(RUNS)), json.loads(f.read_text())))
    return found


def key_figures(metrics: dict) -> str:
    parts = [f"np={metrics.get('world_size', '?')}", metrics.get("device", "")]
    for key, fmt in (("val_accuracy", "acc={:.3f}"), ("samples_per_s", "{:.0f} samples/s"),
                     ("final_train_loss", "loss={:.3f}")):
        if isinstance(metrics.get(key), (int, float)):
            parts.append(fmt.format(metrics[key]))
    return " ".join(p for p in parts if p)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="*", help="run only notebooks whose name starts with one of these")
    parser.add_argument("--record-times", action="store_true",
                        help="store each notebook's time in notebooks/times.json (quick or full mode, as run) and "
                             "rewrite the README's table and the notebooks' Time lines from it")
    args = parser.parse_args(argv)
    notebooks = sorted(p for p in NOTEBOOKS.glob("*.ipynb")
                       if not args.prefixes or p.name.startswith(tuple(args.prefixes)))
    print(f"Executing {len(notebooks)} notebook(s){' in QUICK mode' if QUICK else ''}; copies in "
          f"{EXECUTED.relative_to(ROOT)}/", flush=True)
    rows, total = [], time.monotonic()
    for path in notebooks:
        print(f"--> {path.name} ...", flush=True)
        t0 = time.time()
        ok, seconds, error = execute(path)
        rows.append((path.name, ok, seconds, runs_written_since(t0)))
        print(f"    {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
        if error:
            print(error[-3000:], flush=True)
    print("\nSummary")
    for name, ok, seconds, runs in rows:
        print(f"  {'ok  ' if ok else 'FAIL'} {seconds:6.0f} s  {name}")
        for run, metrics in runs:
            print(f"  {'':17}{run}: {key_figures(metrics)}")
    failed = [name for name, ok, *_ in rows if not ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} notebooks ok in {time.monotonic() - total:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.record_times:
        from course import times
        from course.quiz import key_mode

        command = (f"{'COURSE_QUICK=1 ' if QUICK else ''}{'COURSE_ANSWER_KEY=1 ' if key_mode() else ''}"
                   f"python -m course.run_notebooks {' '.join(args.prefixes)}")
        run = times.record([(name, ok, seconds) for name, ok, seconds, _ in rows], QUICK, command.strip())
        print(f"times recorded as run {run!r} in {times.TIMES.relative_to(ROOT)}; rewrote: "
              + (", ".join(times.apply()) or "nothing"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
