"""Load the course's datasets: the generated ones under the course's data/ folder, or real data when
--data-dir, COURSE_FLOWERS_DIR or COURSE_MNIST_DIR point elsewhere. Generating them is `course.datagen`'s job
(`make data`).

This file imports torch, torchvision, numpy and PIL only (nothing else of the course), so that a learner can
copy it beside a training script, the way pytorch/examples ships a datautils.py, and replace it with their own.
Every problem is found before training starts and raised as DatasetError, one sentence naming the path and
the fix: a missing or half-generated folder, an unreadable image, an MNIST folder without MNIST in it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, TensorDataset
from torchvision import datasets, transforms

DATA_DIR = Path(__file__).resolve().parents[2] / "data"  # the course's data/ (where `make data` writes)
# Copied into a learner's project (without course/datagen.py beside it) there is no generated data: a dataset
# must be named (--data-dir, or COURSE_<NAME>_DIR).
IN_COURSE = (Path(__file__).parent / "datagen.py").exists()
WHAT = {"flowers": "a folder of class subfolders of images",
        "mnist": "a folder with mnist.npz or torchvision's MNIST files"}
MARKER = ".complete"  # written last by `make data`: a folder without it is half generated
GENERATING = ".generating"  # written first by `make data`, removed with MARKER's arrival
DATASETS = ("flowers", "mnist")
DOWNLOADED = ".downloaded"  # written by the one process that downloaded real MNIST; the others wait for it
DOWNLOAD_WAIT_S = 600

# Image counts of the classic TensorFlow flower_photos set (3670 images).
FLOWER_CLASSES = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class DatasetError(Exception):
    """A dataset is missing or unusable; the message says which path and what to do."""


# ---------------------------------------------------------------------------------------- loading


def split_indices(n: int, val_fraction: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) index lists: the same on every rank, run and platform."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(n * val_fraction)
    return sorted(order[n_val:]), sorted(order[:n_val])


def load_image(path: str) -> Image.Image:
    """ImageFolder loader whose failures name the file (policy: a corrupt image stops the run)."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as error:  # PIL's ways of saying "not a readable image"
        raise DatasetError(f"unreadable image: {path} ({error}); delete or replace it") from error


def check_images(dataset) -> int:
    """Decode every image of an ImageFolder-based dataset (or a view of one) once, cheaply: DatasetError names
    the first file that cannot be read. Returns the number of files checked.

    JPEG draft mode decodes at 1/8 scale, which still reads every byte: a truncated file fails here
    (about 4000 small images/s on one core), not in the middle of an epoch on one rank.
    """
    while not hasattr(dataset, "samples") and hasattr(dataset, "base"):  # the train/val views below
        dataset = dataset.base
    for path, _ in dataset.samples:
        try:
            with Image.open(path) as image:
                image.draft("RGB", (16, 16))
                image.load()
        except (OSError, ValueError, SyntaxError) as error:  # PIL's ways of saying "not a readable image"
            raise DatasetError(f"unreadable image: {path} ({error}); delete or replace it") from None
    return len(dataset.samples)


def denormalize(images: torch.Tensor) -> torch.Tensor:
    """Normalized [N,3,H,W] flower images back to [0,1] for display (TensorBoard's add_images, matplotlib)."""
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float() * std + mean).clamp(0, 1)


class _View(Dataset):
    """Part of a dataset seen through its own transform (train and val share one folder scan)."""

    def __init__(self, base, indices, transform):
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        image, label = self.base[self.indices[i]]
        return self.transform(image), label


def _resolve_dir(name: str, data_dir) -> tuple[Path, str]:
    """The directory to load and where it came from: "default" (the generated one), "env" (COURSE_<NAME>_DIR,
    which may ask for a download of real MNIST) or "arg" (--data-dir: read only)."""
    if data_dir is not None:
        return Path(data_dir).expanduser(), "arg"
    env = os.environ.get(f"COURSE_{name.upper()}_DIR") or None  # empty means unset
    if env is not None:
        return Path(env).expanduser(), "env"
    if not IN_COURSE:
        raise DatasetError(f"no {name} dataset given: pass --data-dir PATH, {WHAT[name]} "
                           f"(or set COURSE_{name.upper()}_DIR)")
    return DATA_DIR / name, "default"


def _check_generated(root: Path, origin: str) -> None:
    """A folder `make data` has begun but not finished is refused (it would train on some classes only)."""
    if (root / GENERATING).exists() or (origin == "default" and root.is_dir() and not (root / MARKER).exists()):
        raise DatasetError(f"{root} is half generated (no {MARKER} marker: `make data` was interrupted); "
                           "run `make data` again")


def flower_transforms(image_size: int):
    """(train, validation) transforms: random crops and flips for training only; a fixed centre crop to evaluate
    (and to predict: the model then sees what it was evaluated on)."""
    normalize = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    train_tf = transforms.Compose([transforms.RandomResizedCrop(image_size, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), *normalize])
    val_tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size), *normalize])
    return train_tf, val_tf


def _flowers(root: Path, origin: str, image_size: int):
    hint = "point --data-dir (COURSE_FLOWERS_DIR) at a flower_photos-style folder"
    hint = f"run `make data`, or {hint}" if IN_COURSE else hint
    if not root.is_dir():
        raise DatasetError(f"flowers folder {root} does not exist; {hint}.")
    _check_generated(root, origin)
    try:
        folder = datasets.ImageFolder(root, loader=load_image)
    except FileNotFoundError as error:  # no class subfolders, or no images in them
        raise DatasetError(
            f"flowers folder {root} has no class subfolders with images ({error}); {hint}.") from error
    if len(folder.classes) < 2:  # one class trains to loss 0 / accuracy 1.0 and means nothing
        raise DatasetError(f"flowers folder {root} has {len(folder.classes)} class folder(s) "
                           f"({', '.join(folder.classes)}); a classifier needs at least two; {hint}.")
    check_images(folder)  # a corrupt image stops the run now, in one line, not in the middle of an epoch
    train_tf, val_tf = flower_transforms(image_size)
    train_idx, val_idx = split_indices(len(folder))
    return _View(folder, train_idx, train_tf), _View(folder, val_idx, val_tf), len(folder.classes)


def _torchvision_mnist(root: Path, download: bool):
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    return tuple(datasets.MNIST(root, train=t, download=download, transform=tf) for t in (True, False))


def _download_mnist(root: Path):
    """Real MNIST into ``root``, downloaded by one process per machine: local rank 0 downloads and then writes
    the DOWNLOADED marker; the other local ranks wait for it (the process group does not exist yet)."""
    marker = root / DOWNLOADED
    if os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            train, val = _torchvision_mnist(root, download=True)
        except (OSError, RuntimeError) as error:  # usually: offline
            raise DatasetError(f"could not download real MNIST into {root} (COURSE_MNIST_DIR) ({error}); "
                               "download it where there is a network, or unset COURSE_MNIST_DIR") from error
        marker.touch()
        return train, val
    deadline = time.monotonic() + DOWNLOAD_WAIT_S
    while not marker.exists():  # if local rank 0 fails, torchrun ends this process
        if time.monotonic() > deadline:
            raise DatasetError(f"waited {DOWNLOAD_WAIT_S} s for local rank 0 to download MNIST into {root}")
        time.sleep(0.5)
    return _torchvision_mnist(root, download=False)


def _mnist(root: Path, origin: str):
    npz = root / "mnist.npz"
    if root.is_dir():
        _check_generated(root, origin)
    if npz.exists():
        with np.load(npz) as arrays:
            def tensors(split):
                images = torch.from_numpy(arrays[f"{split}_images"]).float().div(255).unsqueeze(1)
                labels = torch.from_numpy(arrays[f"{split}_labels"]).long()
                return TensorDataset((images - MNIST_MEAN) / MNIST_STD, labels)
            return tensors("train"), tensors("val"), 10
    if origin == "default":
        raise DatasetError(f"{npz} does not exist; run `make data` (or `python -m course.datagen`).")
    try:  # a torchvision MNIST root that already holds the files: read it, never download
        train, val = _torchvision_mnist(root, download=False)
        return train, val, 10
    except RuntimeError:  # "Dataset not found"
        pass
    if origin == "env":  # COURSE_MNIST_DIR: the one setting that asks for real MNIST, downloaded if missing
        return (*_download_mnist(root), 10)
    raise DatasetError(f"MNIST folder {root} holds neither mnist.npz (`make data` writes one to data/mnist) nor "
                       f"torchvision's MNIST files; pass the folder that does, or set COURSE_MNIST_DIR={root} "
                       "(without --data-dir) to download real MNIST there")


def build_datasets(name: str, data_dir: str | Path | None = None,
                   image_size: int = 64) -> tuple[Dataset, Dataset, int]:
    """Return (train_set, val_set, num_classes) for "flowers" or "mnist".

    data_dir (--data-dir) is read, never written; else $COURSE_FLOWERS_DIR / $COURSE_MNIST_DIR; else the
    generated data/<name>, which must be complete (`make data` writes its .complete marker last).
    flowers: any folder of class subfolders with images (e.g. the real flower_photos), split 80/20
    by `split_indices`; train images get RandomResizedCrop + flip, val Resize + CenterCrop, both
    `image_size` px. Every image is decoded once first: a corrupt one raises DatasetError naming the file.
    mnist: a folder with mnist.npz (generated), or a torchvision MNIST root holding the files; only
    COURSE_MNIST_DIR downloads real MNIST into a folder without them (one process per machine does).
    Problems raise DatasetError with a one-sentence fix.
    """
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
    root, origin = _resolve_dir(name, data_dir)
    return _flowers(root, origin, image_size) if name == "flowers" else _mnist(root, origin)
