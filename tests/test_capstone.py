"""Notebook 07's scripts: train_flowers.py (bad input refused before training, a tiny train + resume with
TensorBoard image and figure summaries, fine-tuning with a frozen backbone, SyncBatchNorm's CPU path) and
predict.py. Whether the full quick run learns is asserted by the notebook itself (tests/test_notebooks.py)."""

import itertools
import os
import shutil
import subprocess
import sys

import pytest
import torch

from course import SCRIPTS, import_script
from course.capstone import read_images, resnet
from course.inline_tensorboard import read_scalars
from course.launcher import launch

CLASSES = ("daisy", "dandelion", "roses", "sunflowers", "tulips")
# 5 x 10 images, 32 px: 40 training images, 10 validation; 2 ranks x 4 samples = global batch 8, 5 steps per epoch
TINY = ["--image-size", "32", "--global-batch", "8", "--batch-size", "4", "--show-images", "8", "--log-every", "2"]


def tiny_flowers(datasets, root, per_class=10):
    """A small flowers folder: the first ``per_class`` generated images of every class."""
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for path in sorted((datasets / "flowers" / name).glob("*.jpg"))[:per_class]:
            shutil.copy(path, root / name / path.name)
    return root


def train(args, tmp_path, name, nproc=2):
    return launch("train_flowers.py", nproc, [*TINY, "--checkpoint-dir", str(tmp_path / name / "ckpt"), *map(str, args)],
                  run_dir=tmp_path / name / "run", timeout=300, check=False, on_line=lambda _: None, quiet=True)


def predict(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "predict.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=120, check=False)


def start_ranks(args, tmp_path, name, world_size=2):
    """The ranks of a 2-process job, started as torchrun would start them, without torchrun: input errors come
    before the process group, so no rendezvous is needed, and each rank's own exit status and stderr are seen."""
    return [subprocess.Popen([sys.executable, str(SCRIPTS / "train_flowers.py"), *TINY, *map(str, args),
                              "--run-dir", str(tmp_path / name / "run"), "--checkpoint-dir", str(tmp_path / name)],
                             env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
                                  "LOCAL_WORLD_SIZE": str(world_size)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world_size)]


def test_bad_input_is_refused_before_training(datasets, tmp_path):
    """A corrupt JPEG (next to a non-image file, which ImageFolder skips), an empty class folder, weights of
    another architecture and a code-running legacy pickle for --pretrained: every rank exits with status 2 before
    training, each printing the same one line naming the file (the launcher shows it once); no traceback, and no
    torch warning about the pickle (issue 21 item 12)."""
    import pickle

    cases = {}
    for problem in ("corrupt_jpeg", "empty_class", "other_architecture", "legacy_pickle"):
        data = tiny_flowers(datasets, tmp_path / problem / "flowers", per_class=4)
        args = ["--data-dir", data, "--epochs", 1]
        if problem == "corrupt_jpeg":  # a JPEG cut in half, and a file that is no image at all
            good = next((data / "roses").glob("*.jpg")).read_bytes()
            (data / "roses" / "broken.jpg").write_bytes(good[: len(good) // 2])
            (data / "roses" / "notes.txt").write_text("not an image")
            named = ["roses/broken.jpg"]
        elif problem == "empty_class":
            (data / "lilies").mkdir()
            named = ["lilies"]
        elif problem == "other_architecture":
            weights = tmp_path / "resnet34.pth"
            torch.save(resnet("resnet34", 1000).state_dict(), weights)
            args += ["--pretrained", weights]
            named = ["resnet34.pth", "resnet18"]
        else:
            evil = tmp_path / "evil.pth"
            evil.write_bytes(pickle.dumps(RunsCode(), protocol=4))
            args += ["--pretrained", evil]
            named = ["evil.pth", "is not a plain tensor checkpoint", "would run code"]
        cases[problem] = (named, start_ranks(args, tmp_path, problem))
    for problem, (named, ranks) in cases.items():
        (out0, err0), (out1, err1) = (rank.communicate(timeout=180) for rank in ranks)
        assert [rank.returncode for rank in ranks] == [2, 2], (problem, err0[-2000:], err1[-2000:])
        assert err0.startswith("error: ") and err0.count("\n") == 1, (problem, err0)
        assert all(name in err0 for name in named), (problem, err0)
        assert err1 == err0 and "epoch" not in out0 + out1, (problem, err1)


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this should never run",))


def test_train_resume_summaries_and_predict(datasets, tmp_path):
    data = tiny_flowers(datasets, tmp_path / "flowers")
    pretrained = tmp_path / "resnet18_1000_classes.pth"  # shaped like torchvision's ImageNet weights
    torch.save(resnet("resnet18", 1000).state_dict(), pretrained)
    first = train(["--data-dir", data, "--epochs", 2, "--sync-bn", "--pretrained", pretrained, "--freeze-epochs", 1],
                  tmp_path, "tiny")
    assert first.returncode == 0, first.output[-3000:]
    m = first.metrics
    assert (m["world_size"], m["global_batch"], m["micro_batch"], m["accumulation_steps"]) == (2, 8, 4, 1)
    assert (m["steps"], m["epochs_done"], len(m["history"])) == (10, 2, 2)
    assert sum(map(sum, m["confusion"])) == 10, "every validation image counted exactly once"
    assert set(m["per_class_accuracy"]) == set(CLASSES)
    # SyncBatchNorm's CPU path: said once, then trained without it
    assert m["sync_bn"] is False and first.output.count("--sync-bn ignored on cpu") == 1
    assert "[rank0]:backbone frozen for epoch(s) 0-0" in first.output
    assert "[rank0]:epoch 1: backbone unfrozen; DDP wrapped again" in first.output
    ckpt = tmp_path / "tiny" / "ckpt"
    assert (ckpt / "best.pt").is_file() and (ckpt / "last.pt").is_file()

    run_dir = tmp_path / "tiny" / "run"
    images = read_images(run_dir)
    assert {"train/augmented", "val/confusion_matrix"} <= set(images), set(images)
    step, grid = images["train/augmented"][0]
    assert step == 0 and grid.ndim == 3 and grid.shape[2] == 3 and grid.std() > 5, "a grid of real images"
    assert images["val/confusion_matrix"][0][0] == 10  # after the last step
    scalars = read_scalars(run_dir)[run_dir.name]
    lrs = dict(scalars["train/lr"])
    peak = 0.2 * 8 / 256
    assert lrs[1] == pytest.approx(peak / 5, rel=1e-5), "step 1 is logged with the rate it used (warm-up)"
    assert lrs[5] == pytest.approx(peak, rel=1e-5) and lrs[10] < lrs[7] < lrs[6], "cosine decay after warm-up"
    assert [s for s, _ in scalars["val/accuracy"]] == [5, 10]

    second = train(["--data-dir", data, "--epochs", 3, "--resume"], tmp_path, "tiny")
    assert second.returncode == 0, second.output[-3000:]
    assert "[rank0]:resumed from last.pt: epoch 2, step 10" in second.output
    assert "epoch 0:" not in second.output and "[rank0]:epoch 2: step 15" in second.output
    assert (second.metrics["steps"], second.metrics["epochs_done"]) == (15, 3)
    assert [h["epoch"] for h in second.metrics["history"]] == [0, 1, 2]
    resumed_scalars = read_scalars(run_dir)[run_dir.name]  # the finished run's curve continues, nothing lost
    assert [s for s, _ in resumed_scalars["val/accuracy"]] == [5, 10, 15]
    assert dict(resumed_scalars["train/lr"])[1] == lrs[1]

    # predict.py on the validation images of a class folder: one line per image, a known class, a probability
    out = predict(data / "roses", "--checkpoint", ckpt / "best.pt", "--top", 2)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("best.pt: resnet18, 32 px") and len(lines) == 1 + 10
    for line in lines[1:]:
        path, guesses = line.rsplit(": ", 1)[0], line.rsplit(": ", 1)[1].split(", ")
        assert path.endswith(".jpg") and len(guesses) == 2
        for guess in guesses:
            name, probability = guess.split()
            assert name in CLASSES and 0 <= float(probability) <= 1

    # a checkpoint of another architecture: one line naming the file, exit 2
    other = tmp_path / "resnet34_as_resnet18.pt"
    torch.save({"model": resnet("resnet34", 5).state_dict(),
                "config": {"model": "resnet18", "image_size": 32, "classes": list(CLASSES)}}, other)
    out = predict(data / "roses", "--checkpoint", other)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and str(other) in out.stderr
    not_a_checkpoint = tmp_path / "notes.pt"
    not_a_checkpoint.write_text("hello")
    out = predict(data / "roses", "--checkpoint", not_a_checkpoint)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "notes.pt" in out.stderr
    legacy = tmp_path / "legacy.pt"  # a plain pickle that would call os.system: refused as such, without a warning
    legacy.write_bytes(__import__("pickle").dumps({"model": RunsCode()}, protocol=4))
    out = predict(data / "roses", "--checkpoint", legacy)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "is not a plain tensor checkpoint: loading it would run code" in out.stderr


def test_global_batch_split_and_learning_rate_schedule(capsys):
    train_flowers = import_script("train_flowers")
    assert train_flowers.accumulation(64, 32, 1) == (32, 2)
    assert train_flowers.accumulation(64, 32, 2) == (32, 1)
    assert train_flowers.accumulation(64, 32, 4) == (16, 1)
    assert train_flowers.accumulation(96, 16, 2) == (16, 3)
    with pytest.raises(SystemExit) as bad:  # a takeaway script: argparse's way, one "error:" line and status 2
        train_flowers.accumulation(64, 32, 3)
    assert bad.value.code == 2
    assert "cannot be split evenly over 3 processes" in capsys.readouterr().err
    lr = [train_flowers.lr_at(step, 1.0, 10, 100) for step in range(100)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lr[9:])) and lr[-1] < 0.001


def test_ddp_refuses_syncbatchnorm_on_cpu():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(resnet("resnet18", 5))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
            DDP(model)
    finally:
        dist.destroy_process_group()
    train_flowers = import_script("train_flowers")
    assert "cpu" not in train_flowers.SYNC_BN_DEVICES


def test_record_reference_refuses_without_gpu():
    from course.hardware import accelerator

    if accelerator()[0] == "cuda":
        pytest.skip("this machine has a GPU: record_reference would record, not refuse")
    out = subprocess.run([sys.executable, "-m", "course.record_reference"], capture_output=True, text=True,
                         timeout=60, cwd=SCRIPTS, check=False)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "no GPU" in out.stderr


def test_the_cpu_thread_note_computes_its_ratio_and_states_no_outcome():
    """Audit N6-7: 07's 1-vs-2-process comparison printed, whatever the runs measured, that the 1-process run's
    threads wait for each other and slow every step, citing a row notebook 03 no longer has. The note now gives
    the ratio of the two runs' samples/s and how each split the step (from their metrics.json), and names what can
    slow either: two runs whose speeds point opposite ways get the same words, only the ratio differs."""
    import nbformat

    from course import ROOT
    from course.capstone import threads_note
    from course.measure import cpu_threads_rule

    rule = cpu_threads_rule(2, cores=2)  # 2 processes x 1 thread vs 1 process x 2 threads
    one = {"world_size": 1, "accumulation_steps": 2, "micro_batch": 32, "samples_per_s": 247.0}
    two = {"world_size": 2, "accumulation_steps": 1, "micro_batch": 32, "samples_per_s": 211.0}
    slower, faster = threads_note(rule, one, two), threads_note(rule, one, {**two, "samples_per_s": 600.0})
    assert slower.startswith("2 processes ran at 0.85x the samples/s of 1") and "at 2.43x" in faster
    assert "2 micro-batches of 32 in turn" in slower and "1 micro-batch of 32 each" in slower
    assert "its 2 threads" in slower and "on 1 thread each" in slower
    assert slower.replace("0.85x", "R") == faster.replace("2.43x", "R")  # no outcome but the computed ratio
    assert threads_note(cpu_threads_rule(2, cores=1), one, two) == ""  # 1 thread each way: nothing split differently
    assert threads_note(rule, one, {**two, "samples_per_s": None}) == ""
    cells = nbformat.read(ROOT / "notebooks" / "07_capstone_flowers.ipynb", as_version=4).cells
    source = "\n".join(c.source for c in cells)
    assert "threads_note(RULE, np1, np2)" in source and "1 rank, 1 thread" not in source
