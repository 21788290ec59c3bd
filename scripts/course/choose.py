"""How to choose a composition of parallelisms (notebook 12): memory per GPU from notebook 08's formulas
(``course.sharding.predict``), bytes per GPU and step inside a node and between nodes, and which layout fits.

    from course.choose import layouts, pick, table, widget
    rows = layouts(psi=70e9, gpu_gb=80, gpus_per_node=8, nodes=16)
    pick(rows)            # of those that fit, the one sending the fewest bytes between nodes
    print(table(rows))    # one line per layout
    widget()              # sliders that call layouts() and print the table again (needs a live kernel)

Model states only (fp32 parameters and gradients, Adam's two moments: 16 bytes per parameter, sharded as each
layout shards them); activations are left out, so a layout "fits" when its model states take at most
``headroom`` of the GPU's memory. Bytes are what one GPU sends per step in rings (``sharding.SENT``): with N
ranks an all-reduce of S bytes sends 2 (N - 1)/N S, an all-gather or reduce-scatter (N - 1)/N S. Tensor
parallelism's own traffic (activations, notebook 10) depends on tokens and width, not on the parameters: it is
listed as such, inside the node. Times are bytes / bandwidth, a lower bound with no overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from course.sharding import SENT, model_states, predict

GB = 1e9


@dataclass
class Layout:
    name: str
    mesh: str  # the device mesh, e.g. "16 x 8 (replicate, shard)"
    gb_per_gpu: float  # model states per GPU
    fits: bool
    intra_bytes: float  # sent per GPU and step over the node's links (NVLink), parameters and gradients only
    inter_bytes: float  # sent per GPU and step between nodes
    note: str = ""


def _fsdp(psi: float, n: int) -> float:
    """Bytes one rank sends per step for FSDP over n ranks: all-gather forward and backward, reduce-scatter."""
    return 2 * SENT["all-gather"](4 * psi, n) + SENT["reduce-scatter"](4 * psi, n) if n > 1 else 0.0


def layouts(psi: float, gpu_gb: float, gpus_per_node: int, nodes: int, headroom: float = 0.8) -> list[Layout]:
    """Four layouts of ``nodes`` x ``gpus_per_node`` GPUs for ``psi`` parameters, simplest first. Pipeline
    parallelism is not a row: it does not shrink the model states below FSDP2's 16 psi / N; it cuts the
    activations each GPU holds and what crosses nodes (activations, point-to-point: notebook 11)."""
    g, r = gpus_per_node, nodes
    n = g * r
    limit = headroom * gpu_gb * GB

    def states(ranks: int) -> float:
        return model_states(predict(psi, ranks)["FSDP2"])  # 16 psi / ranks

    ddp = model_states(predict(psi, n)["DDP"])
    rows = [
        Layout("DDP", f"{n} (replicate)", ddp / GB, ddp <= limit,
               SENT["all-reduce"](4 * psi, n) if r == 1 else 0.0,
               SENT["all-reduce"](4 * psi, n) if r > 1 else 0.0, "every GPU holds everything"),
        Layout("HSDP", f"{r} x {g} (replicate, shard)", states(g) / GB, states(g) <= limit, _fsdp(psi, g),
               SENT["all-reduce"](4 * psi / g, r) if r > 1 else 0.0, "sharded inside a node, replicated across"),
        Layout("FSDP2", f"{n} (shard)", states(n) / GB, states(n) <= limit, _fsdp(psi, n) if r == 1 else 0.0,
               _fsdp(psi, n) if r > 1 else 0.0, "sharded over every GPU; all of it crosses nodes"),
        Layout("FSDP2 x TP", f"{r} x {g} (dp, tp)", states(n) / GB, states(n) <= limit, 0.0,
               _fsdp(psi / g, r) if r > 1 else 0.0,
               "TP inside the node (plus its activation traffic, notebook 10), FSDP2 across nodes"),
    ]
    return rows


def pick(rows: list[Layout]) -> Layout | None:
    """Of the layouts that fit, the one that sends the fewest bytes between nodes (the slow link); on a tie
    the earlier one in the table (less machinery). None if none fits."""
    fitting = [row for row in rows if row.fits]
    return min(fitting, key=lambda row: row.inter_bytes) if fitting else None


def table(rows: list[Layout], intra_gbps: float = 450.0, inter_gbps: float = 50.0) -> str:
    """The layouts as text: memory, fit, bytes sent per GPU and step, and those bytes in milliseconds at the
    given bandwidths (GB/s per GPU; defaults: an NVLink-class node, a 400 Gb/s network)."""
    lines = [f"{'layout':<17}{'mesh':<30}{'GB/GPU':>8}  {'fits':<5}{'node GB':>9}{'ms':>7}{'network GB':>12}{'ms':>7}"]
    for row in rows:
        lines.append(f"{row.name:<17}{row.mesh:<30}{row.gb_per_gpu:>8.1f}  {'yes' if row.fits else 'no':<5}"
                     f"{row.intra_bytes / GB:>9.2f}{1e3 * row.intra_bytes / (intra_gbps * GB):>7.0f}"
                     f"{row.inter_bytes / GB:>12.2f}{1e3 * row.inter_bytes / (inter_gbps * GB):>7.0f}  {row.note}")
    best = pick(rows)
    lines.append(f"fits, and sends the fewest bytes between nodes: {best.name} ({best.mesh})" if best else
                 "none fits: model states need more GPUs (pipeline stages do not shrink them below 16 psi / N)")
    return "\n".join(lines)


def widget():
    """Sliders for the model, the GPU and the cluster; each change prints ``table(layouts(...))`` again."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = {
        "psi": widgets.FloatLogSlider(value=7e9, base=10, min=8, max=12, step=0.05, description="parameters",
                                      readout_format=".2e"),
        "gpu_gb": widgets.Dropdown(options=[24, 40, 80, 141, 192], value=80, description="GB per GPU"),
        "gpus_per_node": widgets.Dropdown(options=[1, 2, 4, 8], value=8, description="GPUs/node"),
        "nodes": widgets.IntSlider(value=4, min=1, max=256, description="nodes"),
        "intra_gbps": widgets.FloatText(value=450.0, description="node GB/s"),
        "inter_gbps": widgets.FloatText(value=50.0, description="network GB/s"),
    }

    def show(psi, gpu_gb, gpus_per_node, nodes, intra_gbps, inter_gbps):
        print(table(layouts(psi, gpu_gb, gpus_per_node, nodes), intra_gbps, inter_gbps))

    out = widgets.interactive_output(show, controls)
    display(widgets.VBox([widgets.HBox(list(controls.values())[:3]), widgets.HBox(list(controls.values())[3:]), out]))
