"""argparse types that reject bad values with one line, and paths that do not depend on the working directory.

    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--run-dir", type=repo_path, default="runs/train_ddp")
"""

import argparse
from pathlib import Path

from course import in_repo


def _number(kind, text: str, low: float, strict: bool):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
    if value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {low}")
    return value


def positive_int(text: str) -> int:
    """An integer > 0 (epochs, batch size, steps between logs)."""
    return _number(int, text, 0, strict=True)


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (workers; max-steps, where 0 means no limit)."""
    return _number(int, text, 0, strict=False)


def positive_float(text: str) -> float:
    """A number > 0 (learning rate)."""
    return _number(float, text, 0.0, strict=True)


def repo_path(text: str) -> Path:
    """A path; a relative one is taken from the course's root folder, whatever the working directory."""
    return in_repo(text)
