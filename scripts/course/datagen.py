"""Generate the course's offline, deterministic datasets: synthetic flower photos and MNIST-style digits.

`python -m course.datagen` (what `make data` runs) writes them under data/. Training processes never
import this module: loading lives in `course.data`.
"""
from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from course.data import DATA_DIR, DATASETS, FLOWER_CLASSES, GENERATING, MARKER
from course.flower_art import make_flower_image

JPEG_QUALITY = 90


# ----------------------------------------------------------------------------- flowers: generation


def flower_class_counts(n_images: int = 3670) -> dict[str, int]:
    """Split n_images over the classes in flower_photos proportions (largest-remainder rounding)."""
    total = sum(FLOWER_CLASSES.values())
    exact = {name: n_images * count / total for name, count in FLOWER_CLASSES.items()}
    counts = {name: int(x) for name, x in exact.items()}
    largest_remainder_first = sorted(exact, key=lambda name: counts[name] - exact[name])
    for name in largest_remainder_first[: n_images - sum(counts.values())]:
        counts[name] += 1
    return counts


def _begin(root: Path) -> None:
    """Mark ``root`` as being generated: course.data refuses it until _end (wherever it is, --data-dir too)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).unlink(missing_ok=True)
    (root / GENERATING).touch()


def _end(root: Path) -> None:
    (root / MARKER).touch()
    (root / GENERATING).unlink(missing_ok=True)


def generate_flowers(root: Path, n_images: int = 3670, seed: int = 0) -> None:
    """Write n_images JPEGs as root/<class>/<class>_<i:05d>.jpg (the flower_photos layout).

    Each image uses its own generator seeded with (seed, image index), so the bytes are the same
    on every run and platform (given the same Pillow/libjpeg), and any subset can be redrawn alone.
    """
    root = Path(root)
    _begin(root)
    index = 0
    for name, count in flower_class_counts(n_images).items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image = make_flower_image(name, np.random.default_rng([seed, index]))
            image.save(root / name / f"{name}_{i:05d}.jpg", quality=JPEG_QUALITY)
            index += 1
    _end(root)


# ------------------------------------------------------------------------------- mnist: generation


def _arc(cx, cy, rx, ry, start, stop, n=14):
    """Points on an ellipse arc; angles in degrees, 0 = right, 90 = down (image coordinates)."""
    a = np.radians(np.linspace(start, stop, n))
    return np.stack([cx + rx * np.cos(a), cy + ry * np.sin(a)], 1)


def _strokes(*parts):
    return [np.asarray(p, float) for p in parts]


# Hand-drawn stroke skeletons in a unit box (x right, y down), two styles per digit. Drawing them
# ourselves, rather than with fonts, keeps the data independent of what fonts a machine has.
_DIGIT_STYLES = {
    0: [_strokes(_arc(.5, .5, .3, .45, 0, 360)), _strokes(_arc(.5, .5, .24, .45, -80, 285))],
    1: [_strokes([(.5, .05), (.5, .95)]), _strokes([(.3, .22), (.52, .05), (.52, .95)])],
    2: [_strokes(np.vstack([_arc(.5, .3, .28, .25, 190, 400), [(.2, .95), (.82, .95)]])),
        _strokes(np.vstack([_arc(.5, .32, .3, .27, 200, 380), _arc(.85, .95, .63, .55, 270, 180)[1:],
                            [(.85, .92)]]))],
    3: [_strokes(np.vstack([_arc(.48, .28, .27, .23, 200, 450), _arc(.48, .72, .3, .25, 270, 520)])),
        _strokes(np.vstack([[(.22, .05), (.78, .05), (.45, .42)], _arc(.48, .7, .3, .27, 270, 520)]))],
    4: [_strokes([(.62, .95), (.62, .05), (.15, .68), (.85, .68)]),
        _strokes([(.25, .05), (.18, .6), (.85, .6)], [(.65, .3), (.65, .95)])],
    5: [_strokes(np.vstack([[(.78, .05), (.3, .05), (.25, .45)], _arc(.5, .67, .3, .28, 220, 500)])),
        _strokes([(.3, .05), (.25, .45)], _arc(.5, .67, .3, .28, 220, 500), [(.3, .05), (.8, .08)])],
    6: [_strokes(np.vstack([_arc(.75, .62, .5, .57, 250, 180), _arc(.5, .7, .25, .25, 180, 540)])),
        _strokes(np.vstack([[(.62, .05), (.3, .55)], _arc(.5, .72, .24, .23, 200, 560)]))],
    7: [_strokes([(.18, .05), (.82, .05), (.4, .95)]),
        _strokes([(.18, .12), (.25, .05), (.82, .05), (.45, .95)], [(.35, .5), (.75, .5)])],
    8: [_strokes(_arc(.5, .27, .22, .22, 0, 360), _arc(.5, .72, .27, .23, 0, 360)),
        _strokes(_arc(.5, .26, .2, .21, 90, 450), _arc(.5, .71, .26, .24, -90, 270))],
    9: [_strokes(_arc(.5, .3, .27, .25, 0, 360), [(.77, .3), (.72, .95)]),
        _strokes(_arc(.48, .3, .26, .25, 0, 360), [(.74, .3), (.7, .7), (.5, .95)])],
}
_GLYPH = 56  # glyphs are drawn at 2x MNIST resolution; bilinear sampling then antialiases them


def _render_glyphs(rng, variants):
    """Glyphs [10, styles * variants, 1, 56, 56]: each style warped `variants` times, like writers."""
    images = []
    for styles in _DIGIT_STYLES.values():
        for strokes in styles:
            for _ in range(variants):
                # a smooth random warp per "writer", plus a random pen width
                k, phase = rng.normal(0, 4, (2, 2)), rng.uniform(0, 2 * np.pi, 2)
                amp = rng.uniform(0.02, 0.08)
                canvas = Image.new("L", (_GLYPH, _GLYPH))
                draw = ImageDraw.Draw(canvas)
                width = int(rng.integers(3, 11))
                for stroke in strokes:
                    warped = stroke + amp * np.sin(stroke @ k.T + phase)
                    # the unit box becomes 40 of 56 px: digits ~20 px tall at 28 px, as in MNIST
                    xy = [(8 + 40 * x, 8 + 40 * y) for x, y in warped]
                    draw.line(xy, fill=255, width=width, joint="curve")
                    for x, y in (xy[0], xy[-1]):  # round pen tips
                        draw.ellipse((x - width / 2, y - width / 2, x + width / 2, y + width / 2), fill=255)
                images.append(np.asarray(canvas))
    return torch.from_numpy(np.stack(images)).float().div(255).view(10, -1, 1, _GLYPH, _GLYPH)


def _sample_digits(glyphs, n, gen, chunk=10000):
    """n random affine-distorted, noisy 28x28 uint8 digits; glyphs [10, per_digit, 1, 56, 56]."""
    per_digit = glyphs.shape[1]
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = []
    for start in range(0, n, chunk):  # chunks bound the memory of the gathered 56x56 glyphs
        y = labels[start:start + chunk]
        m = len(y)
        rand = torch.rand(m, 8, generator=gen)
        source = glyphs[y, (rand[:, 0] * per_digit).long()]
        angle = (rand[:, 1] - 0.5) * math.radians(30)  # rotation +-15 degrees
        scale_x = 0.8 + 0.35 * rand[:, 2]
        scale_y = scale_x * (0.9 + 0.2 * rand[:, 3])
        shear = (rand[:, 4] - 0.5) * 0.7
        shift = (rand[:, 5:7] - 0.5) * 0.4  # +-3 px in normalized coordinates
        cos, sin = torch.cos(angle), torch.sin(angle)
        # affine_grid maps output -> input coordinates, so this is the inverse of the distortion
        theta = torch.zeros(m, 2, 3)
        theta[:, 0, 0], theta[:, 0, 1] = cos / scale_x, (sin + shear) / scale_x
        theta[:, 1, 0], theta[:, 1, 1] = -sin / scale_y, cos / scale_y
        theta[:, :, 2] = shift
        grid = F.affine_grid(theta, [m, 1, 28, 28], align_corners=False)
        x = F.grid_sample(source, grid, align_corners=False)
        ink = 0.75 + 0.25 * rand[:, 7].view(m, 1, 1, 1)  # pen pressure
        noise = 1 + 0.15 * torch.randn(x.shape, generator=gen)  # only on ink: MNIST background is 0
        images.append((x * ink * noise).clamp(0, 1).mul(255).round().to(torch.uint8).squeeze(1))
    return torch.cat(images), labels


def generate_mnist(root: Path, n_train: int = 60000, n_val: int = 10000, seed: int = 0) -> None:
    """Write root/mnist.npz: MNIST-shaped uint8 [N,28,28] digits with int64 labels, train and val.

    Validation digits come from "writers" (glyph warps) never seen in training.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    train_glyphs, val_glyphs = _render_glyphs(rng, 64), _render_glyphs(rng, 16)
    gen = torch.Generator().manual_seed(seed)
    train_images, train_labels = _sample_digits(train_glyphs, n_train, gen)
    val_images, val_labels = _sample_digits(val_glyphs, n_val, gen)
    _begin(root)
    np.savez(root / "mnist.npz", train_images=train_images.numpy(), train_labels=train_labels.numpy(),
             val_images=val_images.numpy(), val_labels=val_labels.numpy())
    write_idx(root, train_images, train_labels, val_images, val_labels)
    _end(root)


def write_idx(root: Path, train_images, train_labels, val_images, val_labels) -> None:
    """The same digits as torchvision's MNIST files (root/MNIST/raw/*-ubyte, IDX format): what
    ``torchvision.datasets.MNIST(root)`` reads, so that the core path's plain scripts load them as real MNIST."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, images, labels in (("train", train_images, train_labels), ("t10k", val_images, val_labels)):
        n = len(images)  # IDX: a magic number (0x0803 images, 0x0801 labels), big-endian sizes, then the bytes
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            np.array([0x803, n, 28, 28], ">i4").tobytes() + images.numpy().astype(np.uint8).tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            np.array([0x801, n], ">i4").tobytes() + labels.numpy().astype(np.uint8).tobytes())


# ------------------------------------------------------------------------------------------ setup


def ensure_datasets(data_dir: Path = DATA_DIR, names=DATASETS, quiet: bool = False,
                    force: bool = False) -> None:
    """Generate each named dataset under data_dir unless its .complete marker is present."""
    generators = {"flowers": generate_flowers, "mnist": generate_mnist}
    for name in names:
        root = Path(data_dir) / name
        if (root / MARKER).exists() and not force and (name != "mnist" or (root / "MNIST" / "raw").is_dir()):
            message = f"{name}: already present in {root}"
        else:
            shutil.rmtree(root, ignore_errors=True)  # a partial or forced folder starts from scratch
            start = time.perf_counter()
            generators[name](root)
            message = f"{name}: generated in {time.perf_counter() - start:.1f} s -> {root}"
        if not quiet:
            print(message, flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Generate the course's offline datasets.")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR,
                        help="where to write (default: %(default)s)")
    parser.add_argument("--only", choices=DATASETS, help="generate just this dataset")
    parser.add_argument("--force", action="store_true", help="regenerate even if already present")
    args = parser.parse_args(argv)
    ensure_datasets(args.data_dir, (args.only,) if args.only else DATASETS, force=args.force)


if __name__ == "__main__":
    main()
