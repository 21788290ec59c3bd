"""`make gpu-check` on a machine without CUDA says so and succeeds; with CUDA it is run by hand (see README)."""

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
