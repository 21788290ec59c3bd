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
    print(result.verdict("2 ranks", "1 rank"))      # "2 ranks: 1.04x (0.91-1.18) the samples/s of 1 rank ..."

A verdict follows the rule below (MIN_ROUNDS, SAME_BAND; RULE says it in one line), so a quick run's two
rounds never decide anything, and a difference every round shows beyond the noise always decides. For 1 process against N on a CPU, cpu_threads_rule(N)
gives both runs their threads and the line to print with the table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from course import flag
from course.train_utils import StepTimer  # noqa: F401 (its home: course.train_utils, which the scripts copy)

# The rule for a verdict (a comparison of two configurations, round by round):
# - faster/slower (better/worse) needs at least MIN_ROUNDS paired rounds whose ratios are all on the same side
#   of 1, each beyond a margin: SAME_BAND, or the larger configuration's own spread (max/min - 1) if that is
#   wider. A difference smaller than what a configuration varies by on its own is not evidence; one that every
#   round shows, beyond both configurations' own spreads, is (notebook 00: 36-74x in every round, own spread 1.97x);
# - "about the same" needs as many rounds and every ratio within SAME_BAND of 1;
# - anything else (rounds that disagree, or a difference within the spreads) is "too noisy to tell", and
#   fewer rounds are "too few to decide".
# In simulations a configuration compared with itself then gives a verdict about once in 10,000 or less,
# whatever the noise, and a unanimous difference beyond the spreads always gets one (tests/test_measure.py);
# python -m course.bench_noise measures both under load.
MIN_ROUNDS = 5
SAME_BAND = 0.05
RULE = (f"verdicts: faster/slower only when all of >= {MIN_ROUNDS} rounds agree, each beyond {SAME_BAND:.0%} and "
        "beyond what either configuration varies by on its own")


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

    @property
    def spread(self) -> float:
        """max/min of the rounds: 1.0 when they all agree; inf when none, or one measured 0 or less."""
        return self.high / self.low if self.values and self.low > 0 else float("inf")

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

    def judge(self, name: str, baseline: str) -> dict:
        """The rule, with its evidence: key ('above', 'below', 'same', 'noisy', 'few' or 'none'), the
        per-round ratios, each configuration's own spread (max/min), the margin used and the counts of
        rounds above 1 + margin and below 1 / (1 + margin)."""
        ratios = self.ratios(name, baseline)
        spreads = {n: self.measurements[n].spread for n in (name, baseline)}
        margin = max(SAME_BAND, max(spreads.values()) - 1)
        up = sum(r > 1 + margin for r in ratios)
        down = sum(r < 1 / (1 + margin) for r in ratios)
        same = sum(1 / (1 + SAME_BAND) <= r <= 1 + SAME_BAND for r in ratios)
        if not ratios:
            key = "none"
        elif len(ratios) < MIN_ROUNDS:
            key = "few"
        elif up == len(ratios):
            key = "above"
        elif down == len(ratios):
            key = "below"
        elif same == len(ratios):
            key = "same"
        else:
            key = "noisy"
        return {"key": key, "ratios": ratios, "spreads": spreads, "margin": margin, "above": up, "below": down}

    def conclusion(self, name: str, baseline: str) -> str:
        """The verdict as one word, for tests and branches: 'above' / 'below' (the rule above holds: >=
        MIN_ROUNDS rounds, every ratio beyond the margin on that side of 1),
        'same' (every ratio within SAME_BAND of 1), or 'noisy' (anything else, too few rounds included)."""
        key = self.judge(name, baseline)["key"]
        return key if key in ("above", "below", "same") else "noisy"

    def verdict(self, name: str, baseline: str, what: str | None = None, equal_work: bool = False) -> str:
        """One sentence, computed from the paired ratios by the rule above: faster/slower (better/worse),
        about the same, too noisy to tell, or too few rounds to decide. equal_work=True labels a
        comparison of the same work done two ways (or twice), whose lesson is that nothing should differ."""
        j = self.judge(name, baseline)
        ratios, key, margin = j["ratios"], j["key"], j["margin"]
        if key == "none":
            return f"{name} vs {baseline}: nothing measured"
        n = len(ratios)
        med, low, high = statistics.median(ratios), min(ratios), max(ratios)
        what = what or ("time" if self.unit in ("s", "ms", "s/step") else self.unit or "value")
        spread = f" ({low:.2f}-{high:.2f})" if n > 1 else ""
        head = f"{name}: {med:.2f}x{spread} the {what} of {baseline}" + (" (equal work)" if equal_work else "")
        timing = self.unit.endswith("/s") or self.unit in ("s", "ms", "s/step")
        good, bad = ("faster", "slower") if timing else ("better", "worse")
        rounds = f"{n} round{'s' if n > 1 else ''}"
        if key == "few":
            then = "the full run decides" if flag("COURSE_QUICK") else f"a verdict needs at least {MIN_ROUNDS}"
            return f"{head} - {rounds}: too few to decide; {then}"
        if key in ("above", "below"):
            word = (good if self.higher_is_better else bad) if key == "above" else \
                (bad if self.higher_is_better else good)
            return f"{head} - {word} in every one of {rounds}, each beyond {margin:.0%}"
        if key == "same":
            return f"{head} - about the same (every one of {rounds} within {SAME_BAND:.0%})"
        worst = max(j["spreads"], key=j["spreads"].get)
        why = (f"the rounds of {worst} alone vary {j['spreads'][worst]:.2f}x" if margin > SAME_BAND
               else f"{SAME_BAND:.0%}")
        return (f"{head} - too noisy to tell: {j['above']} of {rounds} above {1 + margin:.2f}x, {j['below']} below "
                f"{1 / (1 + margin):.2f}x, {n - j['above'] - j['below']} between (margin {margin:.0%}: {why})")

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


class ThreadRule(NamedTuple):
    """CPU threads for a 1-vs-N comparison: each of the N processes, the 1 process, and the line to print."""

    n_process_threads: int
    one_process_threads: int
    line: str


def cpu_threads_rule(nproc: int, cores: int | None = None) -> ThreadRule:
    """The one rule for comparing 1 process with ``nproc`` processes on a CPU: total threads equal.

    Each of the N processes gets ``cores // nproc`` threads (at least 1) and the single process gets as
    many threads as the N processes have together (at most ``cores``). Why this rule and not "threads per
    process equal": the question such a comparison asks is whether this machine trains faster split into
    N processes than as one, so both runs must use the same cores. With equal threads per process the
    single process would leave cores idle that the N processes use, and N processes would look faster
    by construction. It is also what ddp_doctor.runner.plan gives each rank. cores: default course.hardware.cpu_cores().
    """
    if nproc < 1:
        raise ValueError("nproc must be at least 1")
    if cores is None:
        from course.hardware import cpu_cores

        cores = cpu_cores()
    per_process = max(1, cores // nproc)
    single = min(cores, nproc * per_process)
    total = nproc * per_process
    line = (f"CPU threads (rule: total threads equal): {nproc} process{'es' if nproc > 1 else ''} x "
            f"{per_process} thread{'s' if per_process > 1 else ''} vs 1 process x {single} "
            f"thread{'s' if single > 1 else ''}, on {cores} CPU core{'s' if cores > 1 else ''}")
    if total > cores:
        line += f" ({nproc} processes need {total} threads: more than the cores, so the totals cannot be equal)"
    return ThreadRule(per_process, single, line)


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
