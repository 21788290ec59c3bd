"""Drawing one synthetic flower photo (``course.datagen`` writes thousands): a class's shape on a cluttered
background, jittered in colour, size, angle and blur so that the classes are learnable but not trivial."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


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
