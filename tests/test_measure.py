"""course.measure: steady-state timing, interleaved comparisons, and verdicts that never contradict their numbers."""

import contextlib
import io
import random
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch

from course.measure import NOISY_SPREAD, SAME_BAND, StepTimer, compare, time_call

RATIO = re.compile(r": (\d+\.\d+)x(?: \((\d+\.\d+)-(\d+\.\d+)\))?")


def check_consistent(verdict: str, ratios: list[float]) -> None:
    """What the sentence claims must follow from the per-round ratios it was computed from."""
    low, high = min(ratios), max(ratios)
    med, shown_low, shown_high = RATIO.search(verdict).groups()
    assert float(med) == pytest.approx(statistics.median(ratios), abs=0.006)
    if len(ratios) > 1:
        assert (float(shown_low), float(shown_high)) == (pytest.approx(low, abs=0.006), pytest.approx(high, abs=0.006))
    if "faster in every" in verdict or "better in every" in verdict:
        assert low > 1 + SAME_BAND or high < 1 - SAME_BAND
    if "about the same" in verdict:
        assert 1 - SAME_BAND <= low and high <= 1 + SAME_BAND
    if "too noisy" in verdict:
        assert len(ratios) < 2 or high / low > NOISY_SPREAD
    if "no clear difference" in verdict:
        assert not (low > 1 + SAME_BAND or high < 1 - SAME_BAND)


def test_verdicts_follow_their_numbers_for_random_measurements():
    rng = random.Random(0)
    for _ in range(500):
        rounds = rng.randint(1, 5)
        scale = rng.choice([0.02, 0.2, 1.0])
        a = [100 * (1 + rng.uniform(-scale, scale)) for _ in range(rounds)]
        b = [100 * rng.choice([0.5, 1.0, 1.03, 2.0]) * (1 + rng.uniform(-scale, scale)) for _ in range(rounds)]
        values = iter(zip(a, b))
        pair = {}

        def run(name, pair=pair, values=values):
            if name == "a":
                pair.update(zip("ab", next(values)))
            return pair[name]

        result = compare({"a": lambda: run("a"), "b": lambda: run("b")}, repeats=rounds, unit="samples/s",
                         cpu_only=True)
        for higher in (True, False):
            result.higher_is_better = higher
            check_consistent(result.verdict("b", "a"), result.ratios("b", "a"))


def test_direction_words_follow_higher_is_better():
    faster = compare({"base": lambda: 1.0, "new": lambda: 2.0}, repeats=3, unit="samples/s", cpu_only=True)
    assert "faster in every one of 3 rounds" in faster.verdict("new", "base")
    slower = compare({"base": lambda: 1.0, "new": lambda: 2.0}, repeats=3, unit="s", higher_is_better=False,
                     cpu_only=True)
    assert "slower in every one of 3 rounds" in slower.verdict("new", "base")
    assert "the time of base" in slower.verdict("new", "base")
    one = compare({"base": lambda: 1.0, "new": lambda: 9.0}, repeats=1, unit="samples/s", cpu_only=True)
    assert "too few to conclude" in one.verdict("new", "base") and one.conclusion("new", "base") == "noisy"


def test_rounds_are_interleaved_and_alternate_order():
    order = []
    compare({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 1}, repeats=4, warmup=1,
            cpu_only=True)
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up round, then A B, B A, ...


def test_table_says_cpu_numbers_on_cpu():
    result = compare({"x": lambda: 3.0}, repeats=2, unit="samples/s", cpu_only=True)
    assert "CPU numbers" in result.table() and "3.00 (3.00-3.00, 2 rounds)" in result.table()


def test_step_timer_excludes_warmup_and_evaluation():
    timer = StepTimer(warmup_steps=2)
    timer.start()
    time.sleep(0.3)  # a slow first step (allocation, caches): warm-up, not timed
    timer.tick(10)
    timer.tick(10)
    for _ in range(3):
        time.sleep(0.02)
        timer.tick(10)
    time.sleep(0.3)  # evaluation between epochs
    timer.start()
    for _ in range(2):
        time.sleep(0.02)
        timer.tick(10)
    summary = timer.summary(world_size=2)
    assert summary["timed_steps"] == 5 and summary["warmup_steps"] == 2
    assert 0.015 < summary["step_time_median_s"] < 0.25  # a step with the 0.3 s warm-up or evaluation in it: >= 0.3
    assert summary["samples_per_s"] == pytest.approx(2 * 50 / sum(timer.durations))
    assert StepTimer(warmup_steps=5).summary()["samples_per_s"] is None  # nothing timed: say so, not 0 or nan


@pytest.fixture
def busy_core():
    """A process spinning on one core for the whole test: the machine is loaded, as on a shared box."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait()


def test_comparison_under_load_never_contradicts_itself(busy_core):
    """Under load the numbers are noisy; what is printed must still agree with what was measured,
    and twice the work must never be reported as faster."""
    torch.set_num_threads(1)
    x = torch.randn(192, 192)

    def work(n):
        def run():
            seconds = time_call(lambda: [x @ x for _ in range(n)], repeats=3, warmup=1)
            return statistics.median(seconds)
        return run

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = compare({"1x work": work(20), "same 1x work": work(20), "2x work": work(40)}, repeats=3,
                         unit="s", higher_is_better=False)
        result.show()
        for name in ("same 1x work", "2x work"):
            print(result.verdict(name, "1x work"))
    printed = out.getvalue()
    assert "CPU numbers" in printed or torch.accelerator.is_available()
    for line, name in zip(printed.splitlines()[-2:], ("same 1x work", "2x work")):
        check_consistent(line, result.ratios(name, "1x work"))
    assert result.conclusion("2x work", "1x work") != "below", printed  # "faster" for twice the work: wrong
