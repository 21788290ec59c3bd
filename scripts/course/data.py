"""Load the course's datasets: the generated ones under data/, or real data when COURSE_FLOWERS_DIR /
COURSE_MNIST_DIR (or `data_dir`) point elsewhere. Generating them is `course.datagen`'s job (`make data`).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, TensorDataset
from torchvision import datasets, transforms

from course import ROOT
from course.errors import CourseError

DATA_DIR = ROOT / "data"
MARKER = ".complete"  # written last, so a half-written dataset folder is detected and regenerated
DATASETS = ("flowers", "mnist")

# Image counts of the classic TensorFlow flower_photos set (3670 images).
FLOWER_CLASSES = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class DatasetError(CourseError):
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


class _View(Dataset):
    """Part of a dataset seen through its own transform (train and val share one folder scan)."""

    def __init__(self, base, indices, transform):
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        image, label = self.base[self.indices[i]]
        return self.transform(image), label


def _resolve_dir(name: str, data_dir) -> tuple[Path, bool]:
    """The directory to load and whether it is the generated default (so `make data` can fix it)."""
    if data_dir is None:
        data_dir = os.environ.get(f"COURSE_{name.upper()}_DIR") or None  # empty means unset
    if data_dir is None:
        return DATA_DIR / name, True
    return Path(data_dir).expanduser(), False


def flower_transforms(image_size: int):
    """(train, validation) transforms: random crops and flips for training only; a fixed centre crop to evaluate
    (and to predict: the model then sees what it was evaluated on)."""
    normalize = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    train_tf = transforms.Compose([transforms.RandomResizedCrop(image_size, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), *normalize])
    val_tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size), *normalize])
    return train_tf, val_tf


def _flowers(root: Path, image_size: int):
    hint = "run `make data`, or point --data-dir (COURSE_FLOWERS_DIR) at a flower_photos-style folder"
    if not root.is_dir():
        raise DatasetError(f"flowers folder {root} does not exist; {hint}.")
    try:
        folder = datasets.ImageFolder(root, loader=load_image)
    except FileNotFoundError as error:  # no class subfolders, or no images in them
        raise DatasetError(
            f"flowers folder {root} has no class subfolders with images ({error}); {hint}.") from error
    if len(folder.classes) < 2:  # one class trains to loss 0 / accuracy 1.0 and means nothing
        raise DatasetError(f"flowers folder {root} has {len(folder.classes)} class folder(s) "
                           f"({', '.join(folder.classes)}); a classifier needs at least two; {hint}.")
    train_tf, val_tf = flower_transforms(image_size)
    train_idx, val_idx = split_indices(len(folder))
    return _View(folder, train_idx, train_tf), _View(folder, val_idx, val_tf), len(folder.classes)


def _mnist(root: Path, is_default: bool):
    npz = root / "mnist.npz"
    if npz.exists():
        with np.load(npz) as arrays:
            def tensors(split):
                images = torch.from_numpy(arrays[f"{split}_images"]).float().div(255).unsqueeze(1)
                labels = torch.from_numpy(arrays[f"{split}_labels"]).long()
                return TensorDataset((images - MNIST_MEAN) / MNIST_STD, labels)
            return tensors("train"), tensors("val"), 10
    if is_default:
        raise DatasetError(f"{npz} does not exist; run `make data` (or `python -m course.datagen`).")
    # Any other folder is a torchvision MNIST root: the one setting that switches to real MNIST.
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    try:
        train, val = (datasets.MNIST(root, train=t, download=True, transform=tf) for t in (True, False))
    except (OSError, RuntimeError) as error:  # usually: offline and not downloaded yet
        raise DatasetError(f"could not load or download real MNIST into {root} ({error}).") from error
    return train, val, 10


def build_datasets(name: str, data_dir: str | Path | None = None,
                   image_size: int = 64) -> tuple[Dataset, Dataset, int]:
    """Return (train_set, val_set, num_classes) for "flowers" or "mnist".

    data_dir defaults to $COURSE_FLOWERS_DIR / $COURSE_MNIST_DIR, else the generated data/<name>.
    flowers: any folder of class subfolders with images (e.g. the real flower_photos), split 80/20
    by `split_indices`; train images get RandomResizedCrop + flip, val Resize + CenterCrop, both
    `image_size` px. A corrupt image is not skipped: loading it raises DatasetError naming the file.
    mnist: a folder with mnist.npz (generated), else a torchvision MNIST root (downloads if needed).
    Problems raise DatasetError with a one-sentence fix.
    """
    root, is_default = _resolve_dir(name, data_dir)
    if name == "flowers":
        return _flowers(root, image_size)
    if name == "mnist":
        return _mnist(root, is_default)
    raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
