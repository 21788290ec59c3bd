"""`make gpu-check` on a machine without CUDA says so and succeeds; with CUDA it is run by hand (see docs/hardware.md)."""

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run `make gpu-check` itself")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    result = subprocess.run([sys.executable, "-m", "course.gpu_check"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU on this machine" in result.stdout


def test_gpu_check_report_lists_failures_with_their_traceback(tmp_path, monkeypatch):
    from course import gpu_check

    monkeypatch.setattr(gpu_check, "REPORT_DIR", tmp_path)
    checks = []
    gpu_check._check("passes", lambda: "fine", checks)
    gpu_check._check("fails", lambda: 1 / 0, checks)
    notebooks = [{"notebook": "03_x.ipynb", "ok": True, "seconds": 9, "error": "",
                  "runs_by_device": {"cuda:0": ["03/a"], "cpu": ["03/np2"]}}]
    report = gpu_check.write_report({"accelerator": "cuda"}, checks, notebooks).read_text()
    assert "ok passes" in report and "**FAILED** fails" in report and "ZeroDivisionError" in report
    assert "on CPU: 03/np2" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run `make gpu-check` itself")
def test_gpu_check_without_cuda_skips_each_connection_check_in_one_line():
    result = subprocess.run([sys.executable, "-m", "course.gpu_check", "--no-notebooks"], capture_output=True,
                            text=True, timeout=120, check=False)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 3, result.stdout + result.stderr
    assert lines[1] == "[gpu-check] skip P2P between GPUs: no CUDA GPU on this machine"
    assert lines[2].startswith("[gpu-check] skip nvidia-smi topo -m: ") or \
        lines[2].startswith("[gpu-check] ok   nvidia-smi topo -m: ")  # a driver without CUDA in this torch


def test_peer_to_peer_matrix_names_each_pair_without_p2p():
    from course.gpu_check import peer_to_peer

    no_p2p = {(0, 2), (2, 0), (1, 2)}  # GPU1 -> GPU2 missing but GPU2 -> GPU1 there: one direction is enough
    found = peer_to_peer(3, lambda i, j: (i, j) not in no_p2p)
    assert found["matrix"] == [[None, True, False], [True, None, False], [False, True, None]]
    assert found["summary"].startswith("no P2P between GPU0-GPU2, GPU1-GPU2: NCCL moves their data through host")
    assert peer_to_peer(2, lambda i, j: True) == {"matrix": [[None, True], [True, None]],
                                                  "summary": "P2P between every pair of the 2 GPUs"}
    assert peer_to_peer(1, None) == {"skipped": "1 CUDA GPU: no pair of GPUs to check"}
    assert peer_to_peer(0, None) == {"skipped": "no CUDA GPU on this machine"}
    assert "RuntimeError: driver says no" in peer_to_peer(2, _raise(RuntimeError("driver says no")))["failed"]


def _raise(exc):
    def fn(*args, **kwargs):
        raise exc
    return fn


def test_nvidia_smi_topology_reports_output_absence_and_failure():
    from course.gpu_check import nvidia_smi_topology

    assert nvidia_smi_topology(which=lambda name: None) == {"skipped": "nvidia-smi not found on PATH: no topology matrix"}
    seen = []

    def run(cmd, **kwargs):
        seen.append((cmd, kwargs["timeout"]))
        return subprocess.CompletedProcess(cmd, 0, stdout="\tGPU0\tGPU1\nGPU0\t X \tPHB\nGPU1\tPHB\t X \n", stderr="")
    out = nvidia_smi_topology(which=lambda name: "/usr/bin/nvidia-smi", run=run)
    assert out == {"output": "\tGPU0\tGPU1\nGPU0\t X \tPHB\nGPU1\tPHB\t X"}
    assert seen == [(["/usr/bin/nvidia-smi", "topo", "-m"], 30)]  # every process the check starts has a timeout
    failed = nvidia_smi_topology(which=lambda name: "nvidia-smi", run=lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 9, stdout="", stderr="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"))
    assert failed == {"failed": "nvidia-smi topo -m exited 9: NVIDIA-SMI has failed because it couldn't communicate "
                                "with the NVIDIA driver"}
    hung = nvidia_smi_topology(which=lambda name: "nvidia-smi",
                               run=_raise(subprocess.TimeoutExpired(["nvidia-smi"], 30)))
    assert hung["failed"].startswith("nvidia-smi topo -m: TimeoutExpired")


def test_connections_are_announced_in_one_line_each_and_written_to_the_report(tmp_path, monkeypatch, capsys):
    from course import gpu_check

    monkeypatch.setattr(gpu_check, "REPORT_DIR", tmp_path)
    smi = "\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X "
    found = gpu_check.topology(2, lambda i, j: False, which=lambda name: "nvidia-smi",
                               run=lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout=smi, stderr=""))
    assert capsys.readouterr().out.splitlines() == [
        ("[gpu-check] ok   P2P between GPUs: no P2P between GPU0-GPU1: NCCL moves their data through host memory "
         "(its shared-memory transport), which is slower than P2P"),
        "[gpu-check] ok   nvidia-smi topo -m: 3 lines (in the report)"]
    report = gpu_check.write_report({"accelerator": "cuda"}, [], [], found).read_text()
    assert "## Connections between GPUs" in report and "| GPU0 | — | **no** |" in report and smi.rstrip() in report
    assert "NCCL_P2P_DISABLE=1" in report
    saved = json.loads((tmp_path / "report.json").read_text())["connections"]
    assert saved["P2P between GPUs"]["matrix"] == [[None, False], [False, None]]
