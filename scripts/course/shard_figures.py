"""Notebook 08's drawings: the predicted memory per rank (with sliders) and predicted against measured.

    prediction_widget()                       # sliders for Ψ, ranks, bf16, device memory; redraws the bars
    draw_prediction(psi, ranks, bf16, 80)     # one chart: bytes per rank of every strategy, and the device line
    draw_measured(predicted, measured)        # per strategy: predicted (hatched) and each rank's measured bytes

Only drawing lives here; the numbers come from course.sharding.predict and from shard_memory.py's run.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from course.sharding import PARTS, STRATEGIES, predict

COLOURS = {"parameters": "#4C72B0", "gradients": "#8DA0CB", "optimizer": "#C9D3E8", "working copies": "#DD8452"}
MODEL_STATES = ("parameters", "gradients", "optimizer")


def draw_prediction(psi: float, ranks: int, bf16: bool, device_gb: float) -> None:
    """Stacked bars of the predicted GB per rank for every strategy, with one device's memory dashed."""
    p = predict(psi, ranks, bf16)
    _, ax = plt.subplots(figsize=(8, 2.8))
    left = [0.0] * len(STRATEGIES)
    for part in PARTS:
        values = [p[s][part] / 1e9 for s in STRATEGIES]
        ax.barh(STRATEGIES, values, left=left, color=COLOURS[part], label=part)
        left = [a + b for a, b in zip(left, values)]
    ax.axvline(device_gb, color="#C44E52", linestyle="--", label=f"one device: {device_gb} GB")
    ax.invert_yaxis()
    ax.set_xlabel("GB per rank (activations not included)")
    ax.set_title(f"{psi / 1e9:.2f} B parameters, {ranks} ranks, Adam, {'bf16 compute' if bf16 else 'fp32'}")
    ax.legend(fontsize=8, loc="lower right")
    plt.show()


def prediction_widget(psi: float = 7e9, ranks: int = 8):
    """Sliders (Ψ, ranks, bf16, GB per device) that redraw :func:`draw_prediction`; needs a live kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    psi_slider = widgets.FloatLogSlider(value=psi, base=10, min=7, max=11, step=0.05, description="Ψ",
                                        readout_format=".2e")
    ranks_slider = widgets.IntSlider(value=ranks, min=1, max=64, description="ranks")
    bf16_box = widgets.Checkbox(value=False, description="bf16 compute")
    device_gb = widgets.Dropdown(options=[24, 40, 80, 141], value=80, description="GB/device")
    chart = widgets.interactive_output(draw_prediction, {"psi": psi_slider, "ranks": ranks_slider, "bf16": bf16_box,
                                                         "device_gb": device_gb})
    display(widgets.VBox([widgets.HBox([psi_slider, ranks_slider]), widgets.HBox([bf16_box, device_gb]), chart]))


def draw_measured(predicted: dict, measured: dict) -> None:
    """For each strategy, a hatched bar of the predicted model states and one bar per rank as measured (MB)."""
    nproc = len(next(iter(measured.values())))
    _, ax = plt.subplots(figsize=(8, 4.2))
    labels, ticks, y = [], [], 0.0
    for s in STRATEGIES:
        rows = [("predicted", predicted[s])] + [(f"rank {r}, measured", measured[s][r]) for r in range(nproc)]
        for who, parts in rows:
            left = 0.0
            for part in MODEL_STATES:
                ax.barh(y, parts[part] / 1e6, left=left, color=COLOURS[part],
                        hatch="//" if who == "predicted" else None, edgecolor="white",
                        label=part if not labels else None)
                left += parts[part] / 1e6
            labels.append(f"{s}, {who}")
            ticks.append(y)
            y += 1
        y += 0.5
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MB per rank (model states; hatched: predicted)")
    ax.set_title(f"ResNet-18 with Adam on {nproc} ranks: predicted and measured")
    ax.legend(fontsize=8, loc="lower right")
    plt.show()
