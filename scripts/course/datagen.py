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
from PIL import Image, ImageDraw, ImageFilter

from course.data import DATA_DIR, DATASETS, FLOWER_CLASSES, GENERATING, MARKER

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


def _jitter(rng, rgb, amount=20):
    """A random nearby colour, so no two petals or images share an exact colour."""
    return tuple(min(255, max(0, int(c + d))) for c, d in zip(rgb, rng.integers(-amount, amount + 1, 3)))


def _rotate(points, angle):
    c, s = math.cos(angle), math.sin(angle)
    return points @ np.array([[c, s], [-s, c]])


def _petal(length, width, n=12):
    """Ellipse outline from the origin out along +x: one petal of a radial flower."""
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return np.stack([length / 2 * (1 + np.cos(t)), width / 2 * np.sin(t)], 1)


def _circle(cx, cy, r, n=16):
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], 1)


class _Pen:
    """Draws in flower-local units (radius 1) placed, rotated and tilted onto the canvas."""

    def __init__(self, draw, cx, cy, radius, spin, tilt, squash):
        self.draw, self.centre, self.radius = draw, np.array([cx, cy]), radius
        # spin turns the flower in its own plane; squash + tilt fake a head seen at an angle
        self.matrix = _rotate(np.eye(2), spin) @ np.diag([1.0, squash]) @ _rotate(np.eye(2), tilt)

    def _xy(self, points):
        return [tuple(p) for p in (np.asarray(points) @ self.matrix * self.radius + self.centre)]

    def poly(self, points, fill):
        self.draw.polygon(self._xy(points), fill=fill)

    def line(self, points, fill, width):
        self.draw.line(self._xy(points), fill=fill, width=max(1, round(width * self.radius)), joint="curve")


def _daisy(pen, rng):
    petal = (250, 250, 250) if rng.random() < 0.8 else (240, 190, 230)  # some pale pink/lilac ones
    n = rng.integers(13, 22)
    for k in range(n):
        shape = _petal(rng.uniform(0.85, 1.05), rng.uniform(0.13, 0.22))
        pen.poly(_rotate(shape, 2 * np.pi * k / n + rng.normal(0, 0.08)), _jitter(rng, petal, 15))
    pen.poly(_circle(0, 0, rng.uniform(0.18, 0.27)), _jitter(rng, (235, 190, 30)))


def _dandelion(pen, rng):
    seed_head = rng.random() < 0.2  # white "clocks" overlap with daisy colours
    colour = (235, 235, 225) if seed_head else (250, 205, 25)
    for length, shade in ((1.0, 10), (0.85, -15), (0.6, -45)):  # long outer rays, darker inner ones
        angles = rng.uniform(0, 2 * np.pi, rng.integers(25, 45))
        directions = np.stack([np.cos(angles), np.sin(angles)], 1)
        ends = length * rng.uniform(0.6, 1.0, (len(angles), 1)) * directions
        rays = np.insert(ends, np.arange(len(ends) + 1), 0.0, axis=0)  # centre, end, centre, ...: one call
        pen.line(rays, _jitter(rng, np.add(colour, shade), 15), 0.05)
    core = (130, 100, 60) if seed_head else (225, 160, 10)
    pen.poly(_circle(0, 0, rng.uniform(0.1, 0.25)), _jitter(rng, core))


def _rose(pen, rng):
    palette = [(200, 25, 45), (215, 40, 70), (235, 120, 155), (240, 200, 60), (245, 150, 60)]
    colour = np.array(palette[rng.choice(5, p=[0.4, 0.25, 0.2, 0.08, 0.07])])
    dark = tuple(int(v) for v in colour * 0.55)
    n = rng.integers(5, 8)
    for k in range(n):  # outer petals
        pen.poly(_rotate(_petal(1.0, 0.9), 2 * np.pi * k / n), _jitter(rng, colour * 0.85, 12))
    pen.poly(_circle(0, 0, 0.72), _jitter(rng, colour, 12))
    turns = rng.uniform(2.5, 4.0)  # the concentric swirl that makes a rose a rose
    t = np.linspace(0, 1, 60)
    angle = 2 * np.pi * turns * t
    spiral = 0.68 * (1 - t)[:, None] * np.stack([np.cos(angle), np.sin(angle)], 1)
    pen.line(spiral, dark, rng.uniform(0.05, 0.09))


def _sunflower(pen, rng):
    petal = (250, 195, 20) if rng.random() < 0.85 else (225, 110, 25)
    n = rng.integers(16, 30)
    for k in range(n):
        shape = _petal(rng.uniform(0.9, 1.05), rng.uniform(0.24, 0.36))
        pen.poly(_rotate(shape, 2 * np.pi * k / n + rng.normal(0, 0.05)), _jitter(rng, petal, 20))
    centre = rng.uniform(0.4, 0.55)
    pen.poly(_circle(0, 0, centre), _jitter(rng, (75, 45, 20), 15))
    for x, y in rng.uniform(-0.7, 0.7, (30, 2)) * centre:  # seed texture
        pen.poly(_circle(x, y, 0.05), _jitter(rng, (110, 70, 30), 30))


_TULIP_CUP = np.array([(-0.55, -0.55), (-0.28, -0.2), (0, -0.7), (0.28, -0.2), (0.55, -0.55),
                       (0.62, 0.1), (0.42, 0.48), (0, 0.58), (-0.42, 0.48), (-0.62, 0.1)])
_TULIP_MIDDLE = np.array([(-0.25, 0.5), (-0.35, -0.1), (0, -0.8), (0.35, -0.1), (0.25, 0.5)])


def _tulip(pen, rng):
    palette = [(210, 30, 40), (125, 40, 140), (240, 120, 20), (235, 110, 160), (245, 215, 50)]
    colour = np.array(palette[rng.choice(5, p=[0.35, 0.2, 0.2, 0.15, 0.1])])
    pen.line([(0, 0.4), (rng.normal(0, 0.3), 4.0)], _jitter(rng, (60, 130, 40)), 0.12)  # stem
    pen.poly(_rotate(_petal(2.2, 0.5), rng.uniform(1.2, 1.9)) + (0, 1.6), _jitter(rng, (50, 120, 40)))  # leaf
    pen.poly(_TULIP_CUP, _jitter(rng, colour * 0.85, 12))
    pen.poly(_TULIP_MIDDLE * rng.uniform(0.85, 1.05), _jitter(rng, colour, 12))


_DRAWERS = {"daisy": _daisy, "dandelion": _dandelion, "roses": _rose, "sunflowers": _sunflower,
            "tulips": _tulip}
_BACKGROUNDS = {  # (top colour, bottom colour): grass, sky, soil, foliage
    "grass": ((70, 120, 45), (35, 85, 25)), "sky": ((100, 150, 215), (185, 210, 235)),
    "soil": ((125, 95, 65), (75, 55, 35)), "foliage": ((30, 60, 30), (80, 110, 50)),
}


def _background(rng, w, h):
    colours = list(_BACKGROUNDS.values())[rng.integers(len(_BACKGROUNDS))]
    top, bottom = (np.array(_jitter(rng, c, 25), np.float32) for c in colours)
    t = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    gradient = top * (1 - t) + bottom * t + np.zeros((1, w, 1), np.float32)
    # low-frequency colour blotches: cheap stand-in for out-of-focus scenery
    coarse = Image.fromarray(rng.integers(98, 158, (4, 4, 3), dtype=np.uint8)).resize((w, h), Image.BILINEAR)
    pixels = np.clip(gradient + np.asarray(coarse, np.float32) - 128, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).resize((2 * w, 2 * h), Image.BILINEAR)  # smooth, so 1x is enough


def _clutter(draw, rng, w, h, count):
    """Leaves and blobs: some behind the flower, a few in front of it (occlusion)."""
    for _ in range(count):
        x, y, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.05, 0.2) * min(w, h)
        leafy = rng.random() < 0.6
        colour = (rng.integers(20, 90), rng.integers(70, 150), rng.integers(20, 70)) if leafy \
            else rng.integers(40, 200, 3)
        outline = _rotate(_petal(2 * r, r * rng.uniform(0.4, 1.0)), rng.uniform(0, 2 * np.pi)) + (x, y)
        draw.polygon([tuple(p) for p in outline], fill=tuple(int(v) for v in colour))


def make_flower_image(name: str, rng: np.random.Generator) -> Image.Image:
    """One synthetic photo of class `name` (80-128 px per side), drawn at 2x and downsampled."""
    w, h = (int(v) for v in rng.integers(80, 129, 2))
    canvas = _background(rng, w, h)
    draw = ImageDraw.Draw(canvas)
    _clutter(draw, rng, 2 * w, 2 * h, rng.integers(2, 8))
    heads = 1 if rng.random() < 0.7 else int(rng.integers(2, 4))
    for _ in range(heads):
        radius = rng.uniform(0.22, 0.45) * min(w, h) * 2 / math.sqrt(heads)
        cx, cy = rng.uniform(0.25, 0.75) * 2 * w, rng.uniform(0.25, 0.75) * 2 * h
        if name != "tulips" and rng.random() < 0.4:  # stems are not a tulip-only cue
            draw.line([(cx, cy), (cx + rng.normal(0, 20), 2 * h)], fill=_jitter(rng, (60, 130, 40)),
                      width=max(2, int(radius * 0.1)))
        if name == "tulips":  # tulips stand upright; radial flowers face any way
            pen = _Pen(draw, cx, cy, radius, 0.0, rng.normal(0, 0.25), 1.0)
        else:
            pen = _Pen(draw, cx, cy, radius, rng.uniform(0, 2 * np.pi), rng.uniform(0, np.pi),
                       rng.uniform(0.55, 1.0))
        _DRAWERS[name](pen, rng)
    _clutter(draw, rng, 2 * w, 2 * h, rng.integers(0, 3))
    image = canvas.reduce(2)
    if rng.random() < 0.3:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.4, 1.0)))  # out of focus
    gain = rng.uniform(0.65, 1.25) * rng.uniform(0.9, 1.1, 3)  # exposure and colour cast
    pixels = np.asarray(image, np.float32) * gain.astype(np.float32)
    pixels += rng.standard_normal(pixels.shape, np.float32) * rng.uniform(2, 10)  # sensor noise
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


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
    _end(root)


# ------------------------------------------------------------------------------------------ setup


def ensure_datasets(data_dir: Path = DATA_DIR, names=DATASETS, quiet: bool = False,
                    force: bool = False) -> None:
    """Generate each named dataset under data_dir unless its .complete marker is present."""
    generators = {"flowers": generate_flowers, "mnist": generate_mnist}
    for name in names:
        root = Path(data_dir) / name
        if (root / MARKER).exists() and not force:
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
