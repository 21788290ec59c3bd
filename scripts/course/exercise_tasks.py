"""Data, models and a step recorder for the exercises of notebook 09 (``course.exercises`` checks them).

The exercise scripts import from here what is not the point of the exercise, as ``train_single.py``
imports its data and models from ``course.data`` and ``course.models``; the checker builds its
single-process reference from the same functions, so that both train exactly the same thing.

- ``wave_datasets()`` / ``WaveNet``: classify noisy waveforms (sine, square, triangle, sawtooth)
  with a small 1-D convolutional network. Exercise 1.
- ``regression_data()`` / ``lab_datasets()`` / ``mlp()``: fit a smooth function of a few inputs with a small
  MLP. Exercises 2, 4, 5 and the debugging lab (6).
- ``Trace``: what a script records for the checker (the loss and the parameters after every step).
"""

import itertools
import math
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

WAVE_CLASSES = ("sine", "square", "triangle", "sawtooth")


def waves(n: int, length: int = 64, seed: int = 0) -> TensorDataset:
    """``n`` noisy waveforms of ``length`` samples, shape (n, 1, length), with their class (0-3)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(WAVE_CLASSES), (n,), generator=g)
    cycles = 1 + 3 * torch.rand(n, 1, generator=g)  # 1 to 4 periods per window
    phase = torch.rand(n, 1, generator=g)
    amplitude = 0.5 + torch.rand(n, 1, generator=g)
    t = torch.arange(length) / length * cycles + phase  # in periods
    frac = t - t.floor()
    shapes = torch.stack([torch.sin(2 * math.pi * t),  # sine
                          torch.where(frac < 0.5, 1.0, -1.0),  # square
                          4 * (frac - 0.5).abs() - 1,  # triangle
                          2 * frac - 1])  # sawtooth
    signal = shapes[labels, torch.arange(n)] * amplitude + 0.3 * torch.randn(n, length, generator=g)
    return TensorDataset(signal.unsqueeze(1), labels)


def wave_datasets() -> tuple[TensorDataset, TensorDataset]:
    """(train, validation): 512 and 301 waveforms. 301 is odd on purpose: padding would show in the counts."""
    return waves(512, seed=1), waves(301, seed=2)


class WaveNet(nn.Module):
    """Two 1-D convolutions and a linear classifier: about 800 parameters, no BatchNorm."""

    def __init__(self, classes: int = len(WAVE_CLASSES)):
        super().__init__()
        # Smooth functions only (tanh, averages): ReLU's kink and max-pooling's ties would let float rounding
        # pick different branches in a 2-process and a 1-process run, and their results drift apart.
        self.features = nn.Sequential(nn.Conv1d(1, 8, 5, padding=2), nn.Tanh(), nn.AvgPool1d(2),
                                      nn.Conv1d(8, 16, 5, padding=2), nn.Tanh(), nn.AdaptiveAvgPool1d(1))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def regression_data(n: int, dim_in: int = 8, dim_out: int = 1, seed: int = 0) -> TensorDataset:
    """``n`` samples of a smooth function of ``dim_in`` inputs, with a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim_in, generator=g)
    w = torch.randn(dim_in, dim_out, generator=g) / math.sqrt(dim_in)
    y = torch.sin(2 * x @ w) + 0.05 * torch.randn(n, dim_out, generator=g)
    return TensorDataset(x, y)


def lab_datasets() -> tuple[TensorDataset, TensorDataset]:
    """(train, validation) of the debugging lab: 256 and 301 samples of 8 inputs, 1 output."""
    return regression_data(256, seed=11), regression_data(301, seed=12)


def mlp(*sizes: int) -> nn.Sequential:
    """Linear layers of the given sizes with Tanh between them, e.g. ``mlp(8, 32, 1)``."""
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


class Trace:
    """Records, for the checker, this rank's loss and parameters after every optimizer step.

        trace = Trace(args.out, rank, model)  # records the parameters at step 0
        ...                                   # after each optimizer.step():
        trace.step(model, loss)
        trace.save()                          # writes <out>/trace_rank<R>.pt
    """

    def __init__(self, out: str | os.PathLike, rank: int, model: nn.Module, **meta):
        self.path = Path(out) / f"trace_rank{rank}.pt"
        self.names = [name for name, _ in model.named_parameters()]
        self.meta = meta
        self.losses: list[float] = []
        self.params = [self._snapshot(model)]

    @staticmethod
    def _snapshot(model):
        return [p.detach().to("cpu", copy=True) for p in model.parameters()]

    def step(self, model: nn.Module, loss: torch.Tensor | float) -> None:
        self.losses.append(float(loss))
        self.params.append(self._snapshot(model))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"names": self.names, "losses": self.losses, "params": self.params, "meta": self.meta},
                   self.path)
