"""`make gpu-check`: on a machine with CUDA GPUs, run the GPU paths of the course and write a short report.

    python -m course.gpu_check              # checks + every notebook in quick mode
    python -m course.gpu_check --no-notebooks

What it runs (sized for about 8 minutes on one GPU): the single-GPU checks that the CPU test suite cannot
reach (nccl process group, DDP on cuda, CUDA AMP with fp16 + GradScaler and bf16, pinned-memory loading,
map_location onto the GPU, memory statistics), then every notebook headless in quick mode. It also reports
how the GPUs are connected: peer-to-peer (P2P) access between each pair (``torch.cuda.can_device_access_peer``)
and ``nvidia-smi topo -m`` where nvidia-smi exists. The report (runs/gpu_check/report.md and report.json) says
what ran on a GPU, what fell back to the CPU and why, and every failure with its traceback. On a machine
without CUDA it says so, says in one line each why the connection checks are skipped, and exits 0.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from course import RUNS

REPORT_DIR = RUNS / "gpu_check"
STATUS = {"ok": "ok  ", "skipped": "skip", "failed": "FAIL"}  # as the console shows each check


def _check(name: str, fn, results: list) -> None:
    start = time.monotonic()
    try:
        detail = fn() or ""
        results.append({"check": name, "ok": True, "detail": str(detail), "seconds": round(time.monotonic() - start, 1)})
    except Exception:  # noqa: BLE001 - the report shows the traceback; the other checks still run
        results.append({"check": name, "ok": False, "detail": traceback.format_exc(limit=8),
                        "seconds": round(time.monotonic() - start, 1)})
    row = results[-1]
    print(f"[gpu-check] {'ok  ' if row['ok'] else 'FAIL'} {name}: {row['detail'].strip().splitlines()[-1:] or ''}",
          flush=True)


def peer_to_peer(count: int, can_access) -> dict:
    """P2P access between each ordered pair of ``count`` CUDA GPUs: ``{"matrix": [[None, True], ...], "summary"}``,
    or ``{"skipped": why}`` with fewer than two GPUs, or ``{"failed": error}``. ``can_access(i, j)`` is
    ``torch.cuda.can_device_access_peer``: whether GPU i can read GPU j's memory directly (over NVLink or PCIe)."""
    if count < 2:
        return {"skipped": f"{count} CUDA GPU: no pair of GPUs to check" if count else "no CUDA GPU on this machine"}
    try:
        matrix = [[None if i == j else bool(can_access(i, j)) for j in range(count)] for i in range(count)]
    except Exception as exc:  # noqa: BLE001 - reported, the other checks still run
        return {"failed": f"can_device_access_peer: {type(exc).__name__}: {exc}"}
    without = [f"GPU{i}-GPU{j}" for i in range(count) for j in range(i + 1, count)
               if not (matrix[i][j] and matrix[j][i])]
    summary = (f"P2P between every pair of the {count} GPUs" if not without else
               f"no P2P between {', '.join(without)}: NCCL moves their data through host memory (its shared-memory "
               f"transport), which is slower than P2P")
    return {"matrix": matrix, "summary": summary}


def nvidia_smi_topology(which=shutil.which, run=subprocess.run, timeout: float = 30) -> dict:
    """``nvidia-smi topo -m`` (how each pair of GPUs, and each GPU and NIC, is connected): ``{"output": text}``,
    ``{"skipped": why}`` without nvidia-smi, or ``{"failed": error}``."""
    exe = which("nvidia-smi")
    if not exe:
        return {"skipped": "nvidia-smi not found on PATH: no topology matrix"}
    try:
        out = run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"failed": f"nvidia-smi topo -m: {type(exc).__name__}: {exc}"}
    if out.returncode:
        return {"failed": f"nvidia-smi topo -m exited {out.returncode}: {(out.stderr or out.stdout).strip()[-300:]}"}
    return {"output": out.stdout.rstrip()}


def topology(count: int | None = None, can_access=None, which=shutil.which, run=subprocess.run) -> dict:
    """Both connection checks, each announced in one line; ``count=None`` asks torch how many CUDA GPUs there are."""
    if count is None:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        can_access = torch.cuda.can_device_access_peer
    found = {"P2P between GPUs": peer_to_peer(count, can_access), "nvidia-smi topo -m": nvidia_smi_topology(which, run)}
    for name, part in found.items():
        status, detail = next(((k, v) for k, v in part.items() if k in ("skipped", "failed")), ("ok", None))
        detail = detail or part.get("summary") or f"{len(part['output'].splitlines())} lines (in the report)"
        print(f"[gpu-check] {STATUS[status]} {name}: {detail}", flush=True)
    return found


def topology_lines(found: dict) -> list[str]:
    """The report's "Connections" section: the P2P matrix, nvidia-smi's matrix, and what to do about a hang."""
    lines = ["", "## Connections between GPUs", ""]
    for name, part in found.items():
        if "skipped" in part or "failed" in part:
            lines.append(f"- {name}: {'skipped' if 'skipped' in part else '**FAILED**'}: "
                         f"{part.get('skipped') or part.get('failed')}")
        elif "matrix" in part:
            n = len(part["matrix"])
            lines += [f"- {name}: {part['summary']}", "", "| can read → | " + " | ".join(f"GPU{j}" for j in range(n))
                      + " |", "|---" * (n + 1) + "|"]
            lines += [f"| GPU{i} | " + " | ".join("—" if v is None else "yes" if v else "**no**" for v in row) + " |"
                      for i, row in enumerate(part["matrix"])]
            lines.append("")
        else:
            lines += [f"- {name}:", "", "```", part["output"], "```", ""]
    lines.append("A multi-GPU job that hangs at its first collective with P2P reported is the known symptom of "
                 "P2P that is reported but broken (PCIe ACS, IOMMU, some consumer cards): try NCCL_P2P_DISABLE=1 "
                 "(docs/hardware.md).")
    return lines


def amp_step(dtype_name: str) -> str:
    import torch

    from course.models import build_model

    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", 0)
    model = build_model("cnn", 5).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)  # bf16 needs no scaler
    images, labels = torch.randn(16, 3, 64, 64, device=device), torch.randint(0, 5, (16,), device=device)
    with torch.autocast("cuda", dtype=dtype):
        out = model(images)
        loss = torch.nn.functional.cross_entropy(out, labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    grad_dtypes = {p.grad.dtype for p in model.parameters()}
    assert out.dtype == dtype and grad_dtypes == {torch.float32}, (out.dtype, grad_dtypes)
    return f"autocast {dtype_name}: activations {out.dtype}, gradients {sorted(map(str, grad_dtypes))}"


def map_location_onto_gpu() -> str:
    import tempfile

    import torch

    from course.checkpoint import load_checkpoint, save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint({"w": torch.ones(3)}, Path(tmp) / "c.pt")
        state = load_checkpoint(path, torch.device("cuda", 0))
    assert state["w"].device.type == "cuda"
    return f"loaded onto {state['w'].device}"


def pinned_loader() -> str:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=16, pin_memory=True)
    batch = next(iter(loader))[0]
    assert batch.is_pinned()
    on_gpu = batch.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return f"pinned batch copied to {on_gpu.device}; max allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB"


def launch_on_gpu(script: str, nproc: int, args: list) -> str:
    from course.launcher import launch

    result = launch(script, nproc=nproc, args=args, run_dir=REPORT_DIR / Path(script).stem, timeout=300,
                    on_line=lambda line: None)
    m = result.metrics or {}
    assert m.get("device", "").startswith("cuda"), f"ran on {m.get('device')} (expected cuda)"
    return f"{nproc} process(es), backend {m.get('backend')}, device {m.get('device')}, " \
           f"{m.get('samples_per_s') or 0:.0f} samples/s, val accuracy {m.get('val_accuracy')}"


def run_notebooks() -> list:
    from course.run_notebooks import NOTEBOOKS, execute, runs_written_since

    rows = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        t0 = time.time()
        ok, seconds, error = execute(path, out_dir=REPORT_DIR / "notebooks")
        devices = {}
        for run, metrics in runs_written_since(t0):
            devices.setdefault(str(metrics.get("device", "?")), []).append(run)
        rows.append({"notebook": path.name, "ok": ok, "seconds": round(seconds), "runs_by_device": devices,
                     "error": error[-3000:]})
        print(f"[gpu-check] {'ok  ' if ok else 'FAIL'} {path.name} in {seconds:.0f} s; runs by device: "
              f"{ {d: len(r) for d, r in devices.items()} }", flush=True)
    return rows


def write_report(hardware: dict, checks: list, notebooks: list, connections: dict | None = None) -> Path:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "report.json").write_text(json.dumps(
        {"hardware": hardware, "checks": checks, "connections": connections, "notebooks": notebooks}, indent=2,
        default=str))
    lines = ["# GPU check", "", f"Hardware: `{json.dumps(hardware, default=str)}`", "", "## Checks", ""]
    lines += [f"- {'ok' if c['ok'] else '**FAILED**'} {c['check']} ({c['seconds']} s): "
              f"{c['detail'].strip().splitlines()[-1] if c['ok'] else ''}" for c in checks]
    for c in checks:
        if not c["ok"]:
            lines += ["", f"### {c['check']}", "```", c["detail"].rstrip(), "```"]
    if connections:
        lines += topology_lines(connections)
    if notebooks:
        lines += ["", "## Notebooks (quick mode)", ""]
        for n in notebooks:
            on_cpu = n["runs_by_device"].get("cpu", [])
            lines.append(f"- {'ok' if n['ok'] else '**FAILED**'} {n['notebook']} ({n['seconds']} s); runs per device: "
                         f"{ {d: len(r) for d, r in n['runs_by_device'].items()} }"
                         + (f"; on CPU: {', '.join(on_cpu[:6])}" if on_cpu else ""))
        lines += ["", ("Runs on the CPU with GPUs present are runs with more processes than GPUs (the launcher "
                       "falls back to gloo on the CPU and says why) or runs that ask for the CPU on purpose.")]
        for n in notebooks:
            if not n["ok"]:
                lines += ["", f"### {n['notebook']}", "```", n["error"].rstrip(), "```"]
    path = REPORT_DIR / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-notebooks", action="store_true", help="only the direct GPU checks")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine, so there is nothing to check here; "
              "the CPU paths are what `make test` covers. Run `make gpu-check` on a machine with a GPU.")
        topology(0)
        return 0
    os.environ.setdefault("COURSE_QUICK", "1")
    from course.hardware import describe

    hardware = describe()
    gpus = torch.cuda.device_count()
    print(f"[gpu-check] {gpus} CUDA GPU(s): {hardware}", flush=True)
    checks: list = []
    mnist_quick = ["--epochs", "1", "--max-steps", "60"]
    _check("train_single.py on cuda", lambda: launch_on_gpu("train_single.py", 1, mnist_quick), checks)
    _check("train_ddp.py, 1 process, nccl", lambda: launch_on_gpu("train_ddp.py", 1, mnist_quick), checks)
    if gpus >= 2:
        _check(f"train_ddp.py, {min(gpus, 8)} processes, nccl",
               lambda: launch_on_gpu("train_ddp.py", min(gpus, 8), mnist_quick), checks)
    _check("CUDA AMP fp16 + GradScaler", lambda: amp_step("float16"), checks)
    _check("CUDA AMP bf16", lambda: amp_step("bfloat16"), checks)
    _check("map_location onto the GPU", map_location_onto_gpu, checks)
    _check("pinned-memory loading + memory statistics", pinned_loader, checks)
    connections = topology()
    notebooks = [] if args.no_notebooks else run_notebooks()
    report = write_report(hardware, checks, notebooks, connections)
    failed = [c["check"] for c in checks if not c["ok"]] + [n["notebook"] for n in notebooks if not n["ok"]]
    failed += [name for name, part in connections.items() if "failed" in part]
    print(f"[gpu-check] report: {report}" + (f"; FAILED: {', '.join(failed)}" if failed else "; all ok"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
