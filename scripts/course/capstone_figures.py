"""Notebook 07's drawings: the learning-rate schedule, TensorBoard's image summaries, predict.py's answers.

    plot_schedule(lrs, steps_per_epoch)    # the rate of every optimizer step, epochs marked
    show_image_summaries(summaries)        # the latest image of each tag read from the event files
    show_predictions(guesses, truth)       # each image with the predicted class; wrong ones in red

Only drawing lives here; the numbers come from train_flowers.py's own functions and from the runs.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

WRONG = "#C44E52"


def plot_schedule(lrs: list[float], steps_per_epoch: int) -> None:
    """One line: the learning rate of every optimizer step, with a dashed line between epochs."""
    _, ax = plt.subplots(figsize=(7, 2.6))
    ax.plot(range(1, len(lrs) + 1), lrs)
    for epoch in range(1, len(lrs) // steps_per_epoch):
        ax.axvline(epoch * steps_per_epoch + 0.5, color="#999", lw=0.8, ls="--")
    ax.set_xlabel("optimizer step (the rate is logged with the step that used it)")
    ax.set_ylabel("learning rate")
    ax.set_title(f"warm-up over epoch 0 to {max(lrs):.3g}, then cosine decay ({steps_per_epoch} steps per epoch)")
    plt.tight_layout()
    plt.show()


def show_image_summaries(summaries: dict) -> None:
    """Draw the latest image of each tag ({tag: [(step, HxWxC array), ...]}), small grids at twice their size."""
    for tag, found in sorted(summaries.items()):
        step, image = found[-1]
        height, width = image.shape[:2]
        inches = min(9.0, 2 * width / 100)  # none wider than 9 inches
        _, ax = plt.subplots(figsize=(inches, inches * height / width + 0.3))
        ax.imshow(image)
        ax.set_title(f"{tag} (step {step})", fontsize=9)
        ax.axis("off")
        plt.show()


def show_predictions(guesses: dict[str, str], truth: dict[str, str]) -> None:
    """Each image (path -> "class probability") titled with the guess and the true class; wrong ones in red."""
    _, axes = plt.subplots(1, len(guesses), figsize=(1.9 * len(guesses), 2.4), squeeze=False)
    for ax, (path, guess) in zip(axes[0], guesses.items()):
        predicted, probability = guess.split()
        true = truth[path.rsplit("/", 1)[-1]]
        ax.imshow(plt.imread(path))
        ax.set_title(f"{predicted} {float(probability):.2f}\n(true: {true})", fontsize=8,
                     color="#222" if predicted == true else WRONG)
        ax.axis("off")
    plt.tight_layout()
    plt.show()
