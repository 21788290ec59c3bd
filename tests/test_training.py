"""The course's training scripts under torchrun (2 gloo ranks for DDP): metrics, equivalence, errors."""

import difflib
import re
import subprocess
import sys

import pytest

from course import ROOT, SCRIPTS
from course.launcher import launch

QUIET = {"on_line": lambda _: None}


def run(script, nproc, args, run_dir, **kw):
    return launch(script, nproc=nproc, args=args, run_dir=run_dir, timeout=600, **QUIET, **kw)


def test_train_single_writes_metrics_and_checkpoint(datasets, tmp_path):
    ckpt = tmp_path / "single.pt"
    m = run("train_single.py", 1, ["--max-steps", 150, "--epochs", 1, "--checkpoint", ckpt], tmp_path / "run").metrics
    assert (m["world_size"], m["steps"], m["global_batch"], m["device"]) == (1, 150, 64, "cpu")
    assert m["val_accuracy"] > 0.85 and m["samples_per_s"] > 0 and m["final_train_loss"] < 1.0
    assert m["val_total"] == 10000
    from course.checkpoint import load_checkpoint

    state = load_checkpoint(ckpt)
    assert state["step"] == 150 and not any(k.startswith("module.") for k in state["model"])


def test_train_ddp_on_two_ranks(datasets, tmp_path):
    ckpt = tmp_path / "ddp.pt"
    result = run("train_ddp.py", 2, ["--max-steps", 100, "--epochs", 1, "--batch-size", 32, "--checkpoint", ckpt],
                 tmp_path / "run")
    m = result.metrics
    assert (m["world_size"], m["backend"], m["batch_per_rank"], m["global_batch"]) == (2, "gloo", 32, 64)
    assert m["val_total"] == 10000, "every validation image counted exactly once"
    assert m["val_accuracy"] > 0.8
    assert "[rank0]:rank 0 (local rank 0) on cpu" in result.output and "[rank1]:rank 1 (local rank 1) on cpu" in result.output
    assert result.output.count("val accuracy") == 2  # the epoch line and the final line, from rank 0 only
    from course.checkpoint import load_checkpoint

    assert not any(k.startswith("module.") for k in load_checkpoint(ckpt)["model"])


def test_ddp_gradient_equals_single_process_gradient(datasets, tmp_path):
    mlp = run("ddp_gradients.py", 2, ["--model", "mlp"], tmp_path / "mlp").metrics
    cnn = run("ddp_gradients.py", 2, ["--model", "cnn"], tmp_path / "cnn").metrics
    assert mlp["max_abs_grad_diff"] <= 1e-6
    assert cnn["max_abs_grad_diff"] > 1e-4, "BatchNorm uses per-rank statistics, so it must differ"


def test_ddp_losses_equal_single_process_losses(datasets, tmp_path):
    common = ["--max-steps", 50, "--log-every", 1, "--epochs", 1]
    single = run("train_single.py", 1, common + ["--batch-size", 64], tmp_path / "single").metrics
    ddp = run("train_ddp.py", 2, common + ["--batch-size", 32], tmp_path / "ddp").metrics
    a, b = single["train_loss_history"], ddp["train_loss_history"]
    assert len(a) == len(b) == 50 and [s for s, _ in a] == [s for s, _ in b]
    assert max(abs(x - y) / abs(x) for (_, x), (_, y) in zip(a, b)) <= 1e-4
    assert a[-1][1] < a[0][1] * 0.7, "the run actually learns"


def test_diff_single_to_ddp_is_exactly_the_five_steps():
    diff = list(difflib.unified_diff((SCRIPTS / "train_single.py").read_text().splitlines(),
                                     (SCRIPTS / "train_ddp.py").read_text().splitlines(), lineterm="", n=1))
    hunks = "\n".join(diff[2:]).split("\n@@")
    steps = {int(s) for s in re.findall(r"DDP step (\d)", "\n".join(hunks))}
    assert steps == {1, 2, 3, 4, 5}
    for hunk in hunks:
        changed = [line[1:] for line in hunk.splitlines()[1:] if line[:1] in "+-"]
        assert "DDP step" in hunk or all(line.startswith(("import ", "from ")) for line in changed), hunk
    ddp = (SCRIPTS / "train_ddp.py").read_text()
    assert 'rank = int(os.environ["RANK"])' in ddp and 'local_rank = int(os.environ["LOCAL_RANK"])' in ddp
    assert "sampler.set_epoch(epoch)" in ddp and "model.module.state_dict()" in ddp


@pytest.mark.parametrize("layout", ["missing", "empty", "loose_files"])
def test_bad_data_dir_gives_one_clear_error_line(tmp_path, layout):
    target = tmp_path / "flowers"
    if layout != "missing":
        target.mkdir()
    if layout == "loose_files":
        (target / "notes.txt").write_text("not an image folder")
    result = subprocess.run([sys.executable, str(SCRIPTS / "train_single.py"), "--dataset", "flowers",
                             "--data-dir", str(target)], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(target) in lines[0], result.stderr


def test_unreadable_image_is_reported_by_path(tmp_path):
    from course.data import generate_flowers

    root = tmp_path / "flowers"
    generate_flowers(root, n_images=40)
    for image in sorted(root.rglob("*.jpg")):  # corrupt every image, so the first batch must hit one
        image.write_bytes(b"not a jpeg")
    result = subprocess.run([sys.executable, str(SCRIPTS / "train_single.py"), "--dataset", "flowers", "--data-dir",
                             str(root), "--max-steps", "1", "--model", "cnn", "--run-dir", str(tmp_path / "r")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert result.returncode != 0
    assert re.search(r"unreadable image: .*" + re.escape(str(root)) + r".*\.jpg", result.stderr), result.stderr[-2000:]
