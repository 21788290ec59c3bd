"""Tests for course.datagen and course.data: deterministic generation, splits, error messages and learnability."""
from __future__ import annotations

import functools
import os
import time
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader

from course import data, datagen

torch.set_num_threads(2)


def file_bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


@pytest.fixture(scope="module")
def flowers_600(tmp_path_factory):
    root = tmp_path_factory.mktemp("flowers")
    datagen.generate_flowers(root, n_images=600)
    return root


@pytest.fixture(scope="module")
def mnist_12k(tmp_path_factory):
    root = tmp_path_factory.mktemp("mnist")
    datagen.generate_mnist(root, n_train=12000, n_val=2000)
    return root


# ---------------------------------------------------------------------------------------- generation


def test_class_counts_match_flower_photos_and_scale_proportionally():
    assert datagen.flower_class_counts(3670) == data.FLOWER_CLASSES
    total = sum(data.FLOWER_CLASSES.values())
    for n in (5, 60, 600, 1001):
        counts = datagen.flower_class_counts(n)
        assert sum(counts.values()) == n
        for name, count in counts.items():
            assert abs(count - n * data.FLOWER_CLASSES[name] / total) < 1


def test_flowers_are_deterministic_jpegs_in_flower_photos_layout(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    datagen.generate_flowers(a, n_images=60, seed=0)
    datagen.generate_flowers(b, n_images=60, seed=0)
    datagen.generate_flowers(c, n_images=60, seed=1)
    assert file_bytes(a) == file_bytes(b)
    assert file_bytes(a).keys() == file_bytes(c).keys()
    assert all(file_bytes(a)[k] != v for k, v in file_bytes(c).items())
    assert (a / data.MARKER).exists()
    assert sorted(p.name for p in a.iterdir() if p.is_dir()) == sorted(data.FLOWER_CLASSES)
    for name, count in datagen.flower_class_counts(60).items():
        files = sorted((a / name).glob("*.jpg"))
        assert [f.name for f in files] == [f"{name}_{i:05d}.jpg" for i in range(count)]
        with Image.open(files[0]) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            assert all(80 <= side <= 128 for side in image.size)


def test_mnist_is_deterministic_and_mnist_shaped(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        datagen.generate_mnist(tmp_path / name, n_train=300, n_val=100, seed=seed)
    a, b, c = (np.load(tmp_path / name / "mnist.npz") for name in "abc")
    for key in ("train_images", "train_labels", "val_images", "val_labels"):
        assert np.array_equal(a[key], b[key])
    assert not np.array_equal(a["train_images"], c["train_images"])
    assert a["train_images"].shape == (300, 28, 28) and a["train_images"].dtype == np.uint8
    assert a["val_images"].shape == (100, 28, 28)
    assert a["train_labels"].dtype == np.int64 and set(a["train_labels"]) == set(range(10))
    assert a["train_images"].max() > 200 and np.median(a["train_images"]) == 0  # ink on black
    assert (tmp_path / "a" / data.MARKER).exists()


def test_ensure_datasets_generates_missing_or_partial_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(datagen, "generate_flowers", functools.partial(datagen.generate_flowers, n_images=10))
    monkeypatch.setattr(datagen, "generate_mnist", functools.partial(datagen.generate_mnist, n_train=50, n_val=10))
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "leftover.tmp").touch()  # a half-written folder: no marker
    datagen.ensure_datasets(tmp_path)
    assert not (tmp_path / "mnist" / "leftover.tmp").exists()
    assert (tmp_path / "flowers" / data.MARKER).exists() and (tmp_path / "mnist" / "mnist.npz").exists()
    assert capsys.readouterr().out.count("generated in") == 2
    datagen.main(["--data-dir", str(tmp_path), "--only", "mnist"])
    assert "already present" in capsys.readouterr().out
    datagen.main(["--data-dir", str(tmp_path), "--only", "mnist", "--force"])
    assert "generated in" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ loading


def test_split_indices_is_stable_disjoint_and_complete():
    train, val = data.split_indices(101)
    assert (train, val) == data.split_indices(101)
    assert len(val) == 20 and set(train).isdisjoint(val) and sorted(train + val) == list(range(101))
    assert data.split_indices(101, seed=1) != (train, val)


def test_build_flowers(flowers_600, monkeypatch):
    train, val, num_classes = data.build_datasets("flowers", flowers_600, image_size=40)
    assert (len(train), len(val), num_classes) == (480, 120, 5)
    image, label = train[0]
    assert image.shape == (3, 40, 40) and image.dtype == torch.float32 and 0 <= label < 5
    assert torch.equal(val[3][0], val[3][0])  # val transform is deterministic
    monkeypatch.setenv("COURSE_FLOWERS_DIR", str(flowers_600))  # the one setting for real data
    assert len(data.build_datasets("flowers")[1]) == 120


def test_build_mnist(mnist_12k):
    train, val, num_classes = data.build_datasets("mnist", mnist_12k)
    assert (len(train), len(val), num_classes) == (12000, 2000, 10)
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and label.dtype == torch.int64
    assert abs(train.tensors[0].mean().item()) < 0.5  # normalized


@pytest.mark.parametrize("layout", ["missing", "empty", "loose_files", "empty_class_folders"])
def test_unusable_flower_folders_raise_a_clear_error(tmp_path, layout):
    root = tmp_path / "flowers"
    if layout != "missing":
        root.mkdir()
    if layout == "loose_files":
        Image.new("RGB", (8, 8)).save(root / "a.jpg")
    if layout == "empty_class_folders":
        (root / "daisy").mkdir()
    with pytest.raises(data.DatasetError, match="make data") as error:
        data.build_datasets("flowers", root)
    assert str(root) in str(error.value)


def test_corrupt_image_fails_naming_the_file_before_any_batch(tmp_path):
    """issue 21 item 4: every script that reads the flowers finds a corrupt JPEG when it builds the datasets,
    in one line naming the file, not mid-epoch in a DataLoader worker."""
    datagen.generate_flowers(tmp_path, n_images=10)
    bad = tmp_path / "roses" / "roses_00000.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated JPEG
    with pytest.raises(data.DatasetError, match="unreadable image") as error:
        data.build_datasets("flowers", tmp_path)
    assert str(bad) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["flowers", "mnist"])
def test_a_half_generated_dataset_is_refused(name, tmp_path, monkeypatch):
    """issue 21 item 5: after an interrupted `make data` the scripts trained on 2 of 5 classes, exit code 0."""
    monkeypatch.setattr(data, "DATA_DIR", tmp_path)
    monkeypatch.delenv(f"COURSE_{name.upper()}_DIR", raising=False)
    root = tmp_path / name
    (datagen.generate_flowers(root, n_images=20) if name == "flowers" else
     datagen.generate_mnist(root, n_train=100, n_val=20))
    assert data.build_datasets(name)[2] > 1  # complete: loads
    (root / data.MARKER).unlink()  # as `make data` leaves a folder it did not finish
    with pytest.raises(data.DatasetError, match="half generated.*run `make data`") as error:
        data.build_datasets(name)
    assert str(root) in str(error.value)
    (root / data.GENERATING).touch()  # generating into a folder passed with --data-dir: refused there too
    with pytest.raises(data.DatasetError, match="half generated"):
        data.build_datasets(name, root)


def test_generation_marks_its_folder_while_it_writes(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(datagen, "make_flower_image", lambda *a: seen.append(sorted(p.name for p in tmp_path.iterdir()))
                        or Image.new("RGB", (8, 8)))
    datagen.generate_flowers(tmp_path, n_images=5)
    assert data.GENERATING in seen[0] and data.MARKER not in seen[0]
    assert (tmp_path / data.MARKER).exists() and not (tmp_path / data.GENERATING).exists()


class FakeMNIST:
    """Stands in for torchvision's MNIST (nothing can be downloaded here): records how it was asked."""
    calls: typing.ClassVar[list] = []

    def __init__(self, root, train, download, transform):
        FakeMNIST.calls.append((os.environ.get("LOCAL_RANK"), train, download))
        if not download and not (Path(root) / "MNIST" / "raw").is_dir():
            raise RuntimeError("Dataset not found. You can use download=True to download it")
        if download:
            (Path(root) / "MNIST" / "raw").mkdir(parents=True, exist_ok=True)

    def __len__(self):
        return 10


@pytest.fixture
def fake_mnist(monkeypatch):
    FakeMNIST.calls = []
    monkeypatch.setattr(data.datasets, "MNIST", FakeMNIST)
    monkeypatch.delenv("COURSE_MNIST_DIR", raising=False)
    return FakeMNIST.calls


@pytest.mark.parametrize("layout", ["missing", "empty"])
def test_a_wrong_mnist_data_dir_is_an_error_never_a_download(layout, tmp_path, fake_mnist):
    """issue 21 item 6: --data-dir at a folder without MNIST started a download, from every rank at once."""
    root = tmp_path / "mnist"
    if layout == "empty":
        root.mkdir()
    with pytest.raises(data.DatasetError, match="neither mnist.npz.*COURSE_MNIST_DIR") as error:
        data.build_datasets("mnist", root)
    assert str(root) in str(error.value)
    assert not [call for call in fake_mnist if call[2]], "nothing is downloaded"


def test_course_mnist_dir_downloads_once_per_machine(tmp_path, fake_mnist, monkeypatch):
    """COURSE_MNIST_DIR asks for real MNIST: local rank 0 downloads; another local rank waits for it, then reads."""
    import threading

    root = tmp_path / "real_mnist"
    monkeypatch.setenv("COURSE_MNIST_DIR", str(root))
    monkeypatch.setenv("LOCAL_RANK", "1")
    waited = threading.Event()

    def rank0_later():
        time.sleep(1.0)
        waited.set()
        monkeypatch.setenv("LOCAL_RANK", "0")  # what local rank 0 does, in its own process
        data._download_mnist(root)

    worker = threading.Thread(target=rank0_later)
    worker.start()
    _, _, classes = data.build_datasets("mnist")  # local rank 1: waits for the marker
    worker.join()
    assert waited.is_set() and classes == 10 and (root / data.DOWNLOADED).exists()
    downloads = [call for call in fake_mnist if call[2]]
    assert len(downloads) == 2 and {call[0] for call in downloads} == {"0"}, fake_mnist  # train and val, rank 0


def test_missing_default_mnist_says_run_make_data(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "DATA_DIR", tmp_path)
    monkeypatch.delenv("COURSE_MNIST_DIR", raising=False)
    with pytest.raises(data.DatasetError, match="make data"):
        data.build_datasets("mnist")


def test_unknown_dataset_name():
    with pytest.raises(data.DatasetError, match="unknown dataset"):
        data.build_datasets("cifar")


# ------------------------------------------------------------------------------------- learnability


def accuracy(model, loader):
    model.eval()
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    model.train()
    return correct / len(loader.dataset)


def train(model, loader, epochs, optimizer):
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def test_mlp_learns_mnist_in_one_epoch(mnist_12k):
    torch.manual_seed(0)
    train_set, val_set, _ = data.build_datasets("mnist", mnist_12k)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    train(model, DataLoader(train_set, 64, shuffle=True), 1, optimizer)
    assert 0.9 < accuracy(model, DataLoader(val_set, 1000)) < 1.0


def test_small_cnn_learns_flowers(flowers_600):
    torch.manual_seed(0)
    train_set, val_set, num_classes = data.build_datasets("flowers", flowers_600, image_size=32)

    def block(c_in, c_out):
        conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        return nn.Sequential(conv, nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2))

    model = nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(64, num_classes))
    train(model, DataLoader(train_set, 32, shuffle=True), 6, torch.optim.Adam(model.parameters(), 3e-3))
    assert accuracy(model, DataLoader(val_set, 120)) > 0.5  # chance is 0.2
