"""Measurements that hold on a busy machine: the one way the course times and compares things.

In a training script, time steady-state steps only (the first steps pay for allocation, caches, lazy
initialisation and DDP's first bucket rebuild):

    timer = StepTimer(warmup_steps=3)
    timer.start()                      # at the start of each epoch (evaluation is not timed)
    for batch in loader:
        ...                            # one training step
        timer.tick(len(batch))
    timer.summary()                    # {"samples_per_s": ..., "timed_steps": ..., ...}

In a notebook, compare configurations interleaved (A B A B ...) and repeated, and let the numbers
speak; the verdict is computed from them, never written in advance:

    result = compare({"1 rank": run_np1, "2 ranks": run_np2}, repeats=3, unit="samples/s")
    result.show()                                   # median, min-max and rounds of each
    print(result.verdict("2 ranks", "1 rank"))      # "2 ranks: 1.04x (0.91-1.18) of 1 rank ..."
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Ratios within this band of 1 are "about the same": below what a 2-core shared box can resolve.
SAME_BAND = 0.05
# A spread of per-round ratios wider than this (max/min) means the machine was too noisy to conclude.
NOISY_SPREAD = 1.5


class StepTimer:
    """Samples per second over the steps after ``warmup_steps``; evaluation between epochs is excluded.

    ``sync``: a function that waits for the device (e.g. ``torch.accelerator.synchronize``), so that a
    GPU's queued work is counted in the step that issued it; None on a CPU.
    """

    def __init__(self, warmup_steps: int = 3, sync: Callable[[], None] | None = None):
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        self.warmup_steps = warmup_steps
        self.sync = sync
        self.steps = 0
        self.durations: list[float] = []
        self.samples = 0
        self._last: float | None = None

    def start(self) -> None:
        """Start (or restart, after evaluation) the clock: call just before the first step of an epoch."""
        if self.sync:
            self.sync()
        self._last = time.perf_counter()

    def tick(self, samples: int) -> None:
        """One step is done; it had ``samples`` samples (on this process)."""
        if self.sync:
            self.sync()
        now = time.perf_counter()
        if self._last is None:
            raise RuntimeError("StepTimer.start() was not called before the first tick()")
        if self.steps >= self.warmup_steps:
            self.durations.append(now - self._last)
            self.samples += samples
        self.steps += 1
        self._last = now

    @property
    def samples_per_s(self) -> float | None:
        """Steady-state samples/s of this process; None when no step after the warm-up was timed."""
        total = sum(self.durations)
        return self.samples / total if total > 0 else None

    def summary(self, world_size: int = 1) -> dict:
        """What a run writes into metrics.json. samples_per_s is summed over ``world_size`` processes."""
        rate = self.samples_per_s
        return {"samples_per_s": rate * world_size if rate is not None else None,
                "timed_steps": len(self.durations), "warmup_steps": min(self.warmup_steps, self.steps),
                "step_time_median_s": statistics.median(self.durations) if self.durations else None}


@dataclass
class Measurement:
    """Every value measured for one configuration, in the order of the rounds."""

    name: str
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def __str__(self) -> str:
        if len(self.values) == 1:
            return f"{_fmt(self.values[0])} (1 round)"
        return f"{_fmt(self.median)} ({_fmt(self.low)}-{_fmt(self.high)}, {len(self.values)} rounds)"


@dataclass
class Comparison:
    """The result of :func:`compare`: the values per configuration, and verdicts computed from them."""

    measurements: dict[str, Measurement]
    unit: str = ""
    higher_is_better: bool = True
    cpu_only: bool | None = None

    def __getitem__(self, name: str) -> Measurement:
        return self.measurements[name]

    def ratios(self, name: str, baseline: str) -> list[float]:
        """``name`` / ``baseline`` for each round: paired, so a slow moment of the machine hits both."""
        a, b = self.measurements[name].values, self.measurements[baseline].values
        return [x / y for x, y in zip(a, b) if y]

    def table(self) -> str:
        width = max(len(n) for n in self.measurements)
        lines = [f"{'configuration':<{width}}  median {self.unit} (min-max, rounds)"]
        lines += [f"{name:<{width}}  {m}" for name, m in self.measurements.items()]
        if self.cpu_only:
            lines.append("(CPU numbers: measured on this machine's CPU cores, not on GPUs)")
        return "\n".join(lines)

    def show(self) -> None:
        print(self.table())

    def conclusion(self, name: str, baseline: str) -> str:
        """The verdict as one word, for tests and branches: 'above' / 'below' (every round's ratio beyond
        the same-band, on that side of 1), 'same', 'unclear' (rounds on both sides, spread moderate) or
        'noisy' (too few rounds, or rounds that disagree by more than NOISY_SPREAD)."""
        ratios = self.ratios(name, baseline)
        if len(ratios) < 2:
            return "noisy"
        low, high = min(ratios), max(ratios)
        if low > 1 + SAME_BAND:
            return "above"
        if high < 1 - SAME_BAND:
            return "below"
        if high / low > NOISY_SPREAD:
            return "noisy"
        if 1 - SAME_BAND <= low and high <= 1 + SAME_BAND:
            return "same"
        return "unclear"

    def verdict(self, name: str, baseline: str, what: str | None = None) -> str:
        """One sentence, computed from the paired ratios: faster/slower (better/worse), about the same,
        no clear difference, or too noisy to tell."""
        ratios = self.ratios(name, baseline)
        if not ratios:
            return f"{name} vs {baseline}: nothing measured"
        med, low, high = statistics.median(ratios), min(ratios), max(ratios)
        what = what or ("time" if self.unit in ("s", "ms", "s/step") else self.unit or "value")
        spread = f" ({low:.2f}-{high:.2f})" if len(ratios) > 1 else ""
        head = f"{name}: {med:.2f}x{spread} the {what} of {baseline}"
        timing = self.unit.endswith("/s") or self.unit in ("s", "ms", "s/step")
        good, bad = ("faster", "slower") if timing else ("better", "worse")
        key = self.conclusion(name, baseline)
        if key in ("above", "below"):
            word = (good if self.higher_is_better else bad) if key == "above" else \
                (bad if self.higher_is_better else good)
            return f"{head} - {word} in every one of {len(ratios)} rounds"
        if key == "same":
            return f"{head} - about the same (every round within {SAME_BAND:.0%})"
        if key == "unclear":
            return f"{head} - no clear difference on this machine (rounds on both sides of 1 or close to it)"
        if len(ratios) < 2:
            return f"{head} - one round only, too few to conclude anything; rerun with repeats >= 3"
        return (f"{head} - too noisy to tell: its rounds disagree by more than {NOISY_SPREAD:.1f}x; "
                "rerun with more repeats on an idle machine")

    def to_dict(self) -> dict:
        return {"unit": self.unit, "higher_is_better": self.higher_is_better,
                "values": {n: m.values for n, m in self.measurements.items()},
                "median": {n: m.median for n, m in self.measurements.items()}}


def compare(configs: dict[str, Callable[[], float]], repeats: int = 3, warmup: int = 0, unit: str = "",
            higher_is_better: bool = True, cpu_only: bool | None = None,
            on_round: Callable[[int, str, float], None] | None = None) -> Comparison:
    """Measure every configuration ``repeats`` times, interleaved, after ``warmup`` untimed rounds.

    configs: name -> a function that runs the configuration once and returns one number (e.g. the
    steady-state samples/s a run wrote into its metrics.json, or seconds per call).
    Rounds alternate the order (A B, B A, ...), so neither configuration always runs on a warm cache.
    cpu_only: True adds "CPU numbers" to the table (default: True when this process sees no accelerator).
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    if cpu_only is None:
        cpu_only = _no_accelerator()
    names = list(configs)
    for _ in range(warmup):
        for name in names:
            configs[name]()
    measurements = {name: Measurement(name) for name in names}
    for round_index in range(repeats):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            value = float(configs[name]())
            measurements[name].values.append(value)
            if on_round:
                on_round(round_index, name, value)
    return Comparison(measurements, unit, higher_is_better, cpu_only)


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` times after ``warmup`` untimed calls (for in-process timing)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _no_accelerator() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.accelerator.is_available()
