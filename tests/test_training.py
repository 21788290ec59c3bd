"""The course's training scripts: equivalence (read from notebook 03's run), errors, bad input refused at start,
previous results never lost; course.checkpoint and the scripts' own atomic save. Their metrics after a short run are
checked on the run tests/test_takeaway.py makes of each script copied alone."""

import json
import math
import os
import subprocess
import sys
import uuid

import pytest
from conftest import executed_notebook

from course import ROOT, SCRIPTS, import_script
from course.scriptdiff import script_diff


def python(script, *args, cwd=ROOT, env=None, wait=True):
    """The script run directly with this Python (no torchrun): stdout and stderr apart."""
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / script), *map(str, args)], cwd=cwd, text=True,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def previous_results(run_dir):
    """A run directory holding a previous run's results, as a finished run leaves them."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.json").write_text('{"previous": true}')
    (run_dir / "events.out.tfevents.1.previous").write_text("previous events")
    return run_dir


def assert_previous_results_intact(run_dir):
    assert json.loads((run_dir / "metrics.json").read_text()) == {"previous": True}
    assert (run_dir / "events.out.tfevents.1.previous").read_text() == "previous events"


@pytest.fixture(scope="module")
def notebook_03():
    """Notebook 03's headless run (shared with tests/test_notebooks.py): it launches ddp_gradients.py,
    ddp_by_hand.py and the single-vs-DDP equivalence runs; the tests below read what they wrote."""
    return executed_notebook("03_ddp_five_steps").require_ok()


def test_ddp_gradient_equals_single_process_gradient(notebook_03):
    models = notebook_03.metrics("gradients")["models"]
    assert models["mlp"]["max_abs_grad_diff"] <= 1e-6
    assert models["cnn"]["max_abs_grad_diff"] > 1e-4, "BatchNorm uses per-rank statistics, so it must differ"


def test_gradients_averaged_by_hand_equal_ddps(notebook_03):
    mlp = notebook_03.metrics("by_hand")["models"]["mlp"]
    assert mlp["max_abs_grad_diff"] <= 1e-6 and mlp["max_abs_weight_diff"] <= 1e-6
    assert mlp["all_reduce_calls_by_hand"] == 4 and len(mlp["ddp_bucket_bytes"]) == 1  # 2 weights + 2 biases


def test_ddp_losses_equal_single_process_losses(notebook_03):
    single = notebook_03.metrics("equivalence/single_b64")
    ddp = notebook_03.metrics("equivalence/ddp_2x32")
    assert (single["global_batch"], ddp["global_batch"], ddp["world_size"]) == (64, 64, 2)
    a, b = single["train_loss_history"], ddp["train_loss_history"]
    assert len(a) == len(b) >= 20 and [s for s, _ in a] == [s for s, _ in b]
    assert max(abs(x - y) / abs(x) for (_, x), (_, y) in zip(a, b)) <= 1e-4
    assert a[-1][1] < a[0][1] * 0.7, "the run actually learns"


def test_diff_single_to_ddp_is_exactly_the_five_steps():
    diff = script_diff("train_single.py", "train_ddp.py")
    assert diff.steps == {1, 2, 3, 4, 5} and not diff.unmarked, diff.summary()
    code_added = [line for line in diff.lines if line.startswith("+") and not line.startswith("+++")
                  and '"""' not in line and not line.startswith("+    torchrun") and not line.startswith("+    python")]
    assert len(code_added) <= 50, f"{len(code_added)} lines added: the five steps should stay short"
    ddp = (SCRIPTS / "train_ddp.py").read_text()
    assert 'rank = int(os.environ.get("RANK", "0"))' in ddp and 'local_rank = int(os.environ.get("LOCAL_RANK", "0"))' in ddp
    assert "sampler.set_epoch(epoch)" in ddp and "model.module.state_dict()" in ddp
    # The device and backend are chosen inline, by the rule notebook 03 teaches; nothing names cuda or nccl.
    assert "torch.accelerator.current_accelerator(" in ddp and "get_default_backend_for_device(" in ddp
    assert '"cuda"' not in ddp and '"nccl"' not in ddp
    # Everything detectable is checked before the process group starts.
    for check in ("datasets.MNIST(", "folder.mkdir(", "parser.error("):
        assert ddp.index(check) < ddp.index("dist.init_process_group("), check
    for name in ("train_single", "train_ddp"):
        first = (SCRIPTS / f"{name}.py").read_text().splitlines()[0]
        assert first.startswith("# Written by notebooks/") and "edit it there" in first


@pytest.mark.parametrize("script", ["train_single", "train_ddp"])
@pytest.mark.parametrize("flag, value", [("--epochs", "0"), ("--batch-size", "-1"), ("--lr", "0"), ("--lr", "nan"),
                                         ("--max-steps", "-1"), ("--log-every", "0"), ("--workers", "x"),
                                         ("--seed", str(2**64))])
def test_bad_values_are_refused_by_the_parser_in_one_line(script, flag, value, monkeypatch, capsys):
    module = import_script(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", flag, value])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"{script}.py: error: argument {flag}:") and value in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_epochs_0_and_a_run_killed_mid_training_keep_the_previous_results(datasets, tmp_path):
    """--epochs 0 is refused before anything is written; a run killed mid-training (SIGKILL, after its first
    logged steps) leaves the previous metrics.json and the previous checkpoint as they were: the plain script
    writes metrics.json only at its end and each checkpoint to a temporary that is then renamed."""
    import signal

    import torch

    run_dir = previous_results(tmp_path / "run")
    checkpoint = tmp_path / "c.pt"
    torch.save({"previous": torch.ones(1)}, checkpoint)
    before = checkpoint.read_bytes()
    zero = python("train_single.py", "--epochs", 0, "--run-dir", run_dir)
    assert zero.returncode == 2 and "argument --epochs: '0' is not a whole number" in zero.stderr
    killed = python("train_single.py", "--log-every", 1, "--run-dir", run_dir, "--checkpoint", checkpoint, wait=False)
    for line in killed.stdout:
        if line.startswith("step 5:"):
            break
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert_previous_results_intact(run_dir)
    assert checkpoint.read_bytes() == before


def test_a_missing_dataset_gives_one_clear_error_line(tmp_path):
    """A --data-dir without MNIST in it is named in one error line per process, before any training or process
    group; every process exits with 2 (the launcher shows the ranks' identical lines once)."""
    missing = tmp_path / "nowhere"
    single = python("train_single.py", "--data-dir", missing, "--run-dir", tmp_path / "run", wait=False)
    ranks = [python("train_ddp.py", "--data-dir", missing, "--run-dir", tmp_path / "ddp",
                    env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
                    wait=False) for r in (0, 1)]
    for name, proc in [("train_single.py", single), ("train_ddp.py", ranks[0]), ("train_ddp.py", ranks[1])]:
        out, err = proc.communicate(timeout=180)
        lines = [line for line in err.strip().splitlines() if "error:" in line]
        assert proc.returncode == 2, err[-2000:]
        assert len(lines) == 1 and lines[0].startswith(f"{name}: error: argument --data-dir: {missing}"), err
        assert "Dataset not found" in lines[0] and "Traceback" not in err and "training images" not in out


def test_unwritable_checkpoint_fails_at_start_naming_the_path(datasets, tmp_path):
    """A checkpoint below a file is refused before training, naming the flag and the folder."""
    (tmp_path / "a_file").write_text("I am a file, not a folder")
    cases = {"file_as_parent": tmp_path / "a_file" / "model.pt", "file_as_grandparent": tmp_path / "a_file" / "x" / "m.pt"}
    procs = {name: python("train_single.py", "--checkpoint", path, "--run-dir", tmp_path / name, wait=False)
             for name, path in cases.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        lines = [line for line in err.strip().splitlines() if "error:" in line]
        assert proc.returncode == 2, (name, err[-2000:])
        assert len(lines) == 1 and "argument --checkpoint: cannot create the folder" in lines[0], (name, err)
        assert str(cases[name].parent) in lines[0] and "training images" not in out, (name, err)


PLAIN = {"train_single.py", "train_ddp.py", "train_dp.py", "train_resumable.py", "train_fsdp.py"}  # argparse's errors


@pytest.mark.parametrize("script", ["train_single.py", "train_ddp.py", "train_dp.py", "train_resumable.py",
                                    "train_fsdp.py", "train_flowers.py"])
def test_a_checkpoint_path_that_is_a_folder_or_below_a_file_is_refused_before_training(script, datasets, tmp_path):
    """issue 35 item 3: train_ddp.py trained a full epoch into --checkpoint weights/ (a folder), then crashed with
    IsADirectoryError. Every script that writes a checkpoint refuses it before training, in one line; run here
    as one process with plain python (the DDP scripts' single-process path)."""
    (tmp_path / "a_file").write_text("not a folder")
    if script == "train_flowers.py":  # --checkpoint-dir holds last.pt and best.pt
        (tmp_path / "ckpts" / "last.pt").mkdir(parents=True)
        cases = {"folder": ["--checkpoint-dir", tmp_path / "ckpts"], "file": ["--checkpoint-dir", tmp_path / "a_file"]}
        named = {"folder": tmp_path / "ckpts" / "last.pt", "file": tmp_path / "a_file"}
        bounded = ["--epochs", 1, "--max-steps", 1, "--image-size", 32]
    elif script == "train_fsdp.py":  # its --checkpoint is a folder (DCP): a file, or below one, it cannot be
        cases = {"folder": ["--checkpoint", tmp_path / "a_file"], "file": ["--checkpoint", tmp_path / "a_file" / "ck"]}
        named = {"folder": tmp_path / "a_file", "file": tmp_path / "a_file"}
        bounded = ["--epochs", 1, "--max-steps", 2]
    else:
        (tmp_path / "ckpt").mkdir()
        cases = {"folder": ["--checkpoint", tmp_path / "ckpt"], "file": ["--checkpoint", tmp_path / "a_file" / "m.pt"]}
        named = {"folder": tmp_path / "ckpt", "file": tmp_path / "a_file"}
        bounded = ["--epochs", 1, "--max-steps", 2]
    procs = {case: python(script, *args, *bounded, "--run-dir", tmp_path / f"run_{case}", wait=False)
             for case, args in cases.items()}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (case, err[-2000:])
        if script in PLAIN:  # argparse's usage, then its one error line
            line = err.strip().splitlines()[-1]
            assert line.startswith(f"{script}: error: argument --checkpoint"), (case, err)
            assert "Traceback" not in err and str(named[case]) in line
        else:
            assert err.count("\n") == 1 and err.startswith("error: cannot write the checkpoint"), (case, err)
            assert str(named[case]) in err, (case, err, out)
        assert "epoch" not in out, (case, out)
    assert not (tmp_path / "run_folder" / "metrics.json").exists()


def test_train_single_started_as_several_processes_stops_in_one_line(datasets, tmp_path):
    """issue 35 item 7: torchrun --nproc-per-node=2 train_single.py trained two models into one checkpoint without
    a word. Started as torchrun starts 2 ranks, rank 0 says the script is not distributed; both exit 2."""
    ranks = [python("train_single.py", "--max-steps", 2, "--checkpoint", tmp_path / "m.pt", "--run-dir", tmp_path,
                    env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
                    wait=False) for r in (0, 1)]
    (out0, err0), (out1, err1) = (proc.communicate(timeout=180) for proc in ranks)
    assert [proc.returncode for proc in ranks] == [2, 2], (err0[-2000:], err1[-2000:])
    for err in (err0, err1):  # every rank refuses, before any training: argparse's one error line each
        assert err.strip().splitlines()[-1] == "train_single.py: error: train_single.py is one process; for " \
            "several, use train_ddp.py", err
    assert out0 + out1 == "" and not (tmp_path / "m.pt").exists()


def test_short_run_from_another_cwd_logs_a_loss_and_writes_relative_to_it(datasets, tmp_path):
    """Fewer steps than --log-every: the loss is the mean of the steps that ran (not nan); fewer steps than
    the warm-up: no speed is made up. Relative --run-dir/--checkpoint are relative to the working directory, as
    in any script a learner copies (the course's launcher runs scripts in the course root)."""
    name = f"_test_cwd_{uuid.uuid4().hex[:8]}"
    result = python("train_single.py", "--max-steps", 3, "--log-every", 10, "--run-dir", f"runs/{name}",
                    "--data-dir", datasets / "mnist",
                    "--checkpoint", f"weights/{name}.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (ROOT / "runs" / name).exists() and not (ROOT / "weights" / f"{name}.pt").exists()
    m = json.loads((tmp_path / "runs" / name / "metrics.json").read_text())
    assert (tmp_path / "weights" / f"{name}.pt").is_file()
    assert list((tmp_path / "runs" / name).glob("events.out.tfevents.*")), "TensorBoard events beside metrics.json"
    assert m["steps"] == 3 and math.isfinite(m["train_loss_history"][-1][1]) and len(m["train_loss_history"]) == 1
    assert math.isnan(m["samples_per_s"]), "3 steps, all warm-up: no speed is made up"
    assert "done: nan samples/s" in result.stdout


def test_notebook_03_step_cells_quote_the_script():
    """Every code line shown in notebook 03's five step cells is in train_ddp.py (so they cannot drift apart)."""
    import nbformat

    script = (SCRIPTS / "train_ddp.py").read_text()
    cells = [c.source for c in nbformat.read(ROOT / "notebooks" / "03_ddp_five_steps.ipynb", as_version=4).cells
             if c.cell_type == "markdown" and c.source.startswith("### Step ")]
    assert [c.split(":")[0] for c in cells] == [f"### Step {n}" for n in range(1, 6)]
    for cell in cells:
        block = cell.split("```python\n", 1)[1].split("```", 1)[0]
        for line in block.splitlines():
            for fragment in line.split("  #", 1)[0].strip().split("..."):
                fragment = fragment.strip(" ,()")
                assert fragment in script, f"{cell.splitlines()[0]}: {fragment!r} is not in train_ddp.py"


# ------------------------------------------------------------------- checkpoints (issue 21 items 7, 8, 11, 12)


def test_checkpoints_keep_the_umask(tmp_path):
    """mkstemp made every checkpoint 0600 whatever the umask; a plain torch.save gives 0666 & ~umask."""
    import torch

    from course.checkpoint import save_checkpoint as save
    old = os.umask(0o022)
    try:
        save({"w": torch.ones(2)}, tmp_path / "a.pt")
        os.umask(0o002)
        save({"w": torch.ones(2)}, tmp_path / "b.pt")
    finally:
        os.umask(old)
    assert oct((tmp_path / "a.pt").stat().st_mode & 0o777) == oct(0o644)
    assert oct((tmp_path / "b.pt").stat().st_mode & 0o777) == oct(0o664)


def test_a_successful_save_leaves_no_temporary_of_killed_writers(tmp_path):
    """Writers killed mid-save (SIGKILL) left their temporaries forever; the next save of the same checkpoint
    removes them (or reuses the one name), and leaves other files alone."""
    import torch

    from course.checkpoint import save_checkpoint as save

    path = tmp_path / "model.pt"
    writer = ("import os, sys, torch\n"
              "from course.checkpoint import save_checkpoint\n"
              "class Slow:\n"
              "    def __reduce__(self):\n"
              "        os.kill(os.getpid(), 9)\n"
              "from pathlib import Path\n"
              "save_checkpoint({'w': torch.ones(1000), 'slow': Slow()}, Path(sys.argv[1]))\n")
    killed = [subprocess.Popen([sys.executable, "-c", writer, str(path)]) for _ in range(2)]
    assert [proc.wait(timeout=120) for proc in killed] == [-9, -9]  # two writers, each killed mid-save
    assert list(tmp_path.glob(".model.pt*")), "the killed writers left their temporaries (the case to fix)"
    (tmp_path / ".other.pt.1.x.tmp").write_text("another checkpoint's temporary")
    save({"w": torch.ones(2)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.1.x.tmp", "model.pt"]


def test_check_writable_names_a_parent_that_is_a_file(tmp_path):
    from course.checkpoint import check_writable
    from course.errors import CourseError

    (tmp_path / "README.md").write_text("a file")
    with pytest.raises(CourseError, match="README.md is a file, not a folder"):
        check_writable(tmp_path / "README.md" / "x.pt")


def test_a_code_running_legacy_pickle_is_refused_as_such(tmp_path, recwarn):
    """A plain (non-zip) pickle that calls os.system: torch says "Unsupported operand 149" and warns about the
    pickle protocol; the course says the file is not a plain tensor checkpoint and would run code."""
    import pickle

    import torch

    from course.checkpoint import read_checkpoint
    from course.errors import CourseError

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("echo this should never run",))

    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps({"model": RunsCode()}, protocol=4))
    zipped = tmp_path / "zipped.pt"
    torch.save({"model": RunsCode()}, zipped)
    for path in (legacy, zipped):
        with pytest.raises(CourseError) as error:
            read_checkpoint(path)
        message = str(error.value)
        assert f"{path} is not a plain tensor checkpoint: loading it would run code" in message, message
        assert "system" in message and "corrupt" not in message
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]
    plain = tmp_path / "plain_legacy.pt"  # an old-format checkpoint of tensors still loads
    torch.save({"w": torch.ones(3)}, plain, _use_new_zipfile_serialization=False)
    assert torch.equal(read_checkpoint(plain)["w"], torch.ones(3))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(plain.read_bytes()[:200])
    with pytest.raises(CourseError, match="corrupt or truncated"):
        read_checkpoint(truncated)
