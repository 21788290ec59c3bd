"""Which composition of parallelisms fits a model and a cluster (notebook 12): memory per GPU from notebook 08's
formulas (``course.sharding.predict``), bytes each GPU sends per step inside its node and between nodes, from
the ring formulas and notebook 10's and 11's collectives, and a pick.

    from course.choose import layouts, pick, table, widget
    rows = layouts(psi=70e9, gpu_gb=80, gpus_per_node=8, nodes=16,   # the model and the cluster
                   tokens=8192, width=8192, layers=80)               # its shape and the tokens per GPU per step
    pick(rows)            # of those that fit, the one sending the fewest bytes between nodes (RULE)
    print(table(rows))    # the bandwidths, one line per layout, then the pick and its rule, computed from the numbers
    widget()              # sliders that call layouts() and print the table again (needs a live kernel)

``layouts`` returns ``Layout`` rows (name, mesh, gb_per_gpu, fits, intra_bytes, inter_bytes, bubble, note), in
this order: DDP, HSDP, FSDP2, FSDP2 x TP, FSDP2 x PP. The same global batch everywhere: ``tokens`` per GPU per
step (sequences x positions), so a group of t GPUs that computes one replica together (TP, PP) works on
t x ``tokens``. ``width`` and ``layers`` default to ``shape(psi)``: for the sizes in ``SHAPES``, published shapes
for 125M (GPT-2 small), 7B and 70B (Llama 2's) and a fitted one for 1B (12 x 20 x 2048^2 = 1.007e9; published 1B
models such as Llama 3.2 1B and Pythia-1B use 16 x 2048); else a transformer with width = 128 x layers
(12 layers width^2 = psi, GPT-3- and Llama-like proportions). ``microbatches`` defaults to 4 per pipeline stage
(GPipe's rule of thumb). Everything is fp32 (``BYTES`` = 4), as the course trains. ``TOKENS`` and ``SHAPES``
are the tokens per GPU and the (layers, width) that notebook 12 prints.

- **Memory:** model states only (fp32 parameters and gradients, Adam's two moments: 16 bytes per parameter,
  divided as each layout divides them); activations are left out, so a layout "fits" when its model states
  take at most ``headroom`` of the GPU's memory.
- **Bytes** are what one GPU sends per step, in rings (``sharding.SENT``: with N ranks an all-reduce of S bytes
  sends 2 (N - 1)/N S, an all-gather or reduce-scatter (N - 1)/N S); "inside the node" over NVLink-class links,
  "between nodes" over the network. A ring that spans nodes is counted as crossing them (its slowest links do).
- **FSDP2 x TP** (tp = the GPUs of a node, dp = the nodes): FSDP2's traffic on 1/tp of the parameters across
  nodes, and tensor parallelism's activations inside the node: per block, the all-reduces that
  ``course.comm_count.predict_block`` predicts for notebook 10's GPT (2 forward, 4 backward; q, k and v are
  separate layers), each of one activation (tokens x width x 4 bytes).
- **HSDP** on one node is FSDP2 with a single replica: its row says so and ``pick`` skips it (HSDP is for
  crossing nodes).
- **FSDP2 x PP** (pp = the nodes, one stage each, dp = the GPUs of a node; on one node pp = its GPUs):
  FSDP2's traffic on 1/pp of the parameters inside each stage's group, one all-gather and one reduce-scatter
  per step: ``torch.distributed.pipelining`` keeps the gathered parameters and defers the gradient sync until
  the last micro-batch (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``), with
  ``reshard_after_forward=False`` as torchtitan sets it under a pipeline (with True, the forward gathers again
  for every micro-batch); and the pipeline's point-to-point sends
  (notebook 11): a middle stage sends its micro-batches' activations forward and their gradients back.
  Its bubble, (p - 1)/(m + p - 1) of each GPU's compute time, costs time this table cannot price (it does not
  model compute): ``pick`` therefore takes a layout with a bubble only when no layout without one fits.

Times are bytes / bandwidth: lower bounds, with no overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from course.comm_count import bytes_sent, predict_block
from course.sharding import SENT, model_states, predict

GB = 1e9
BYTES = 4  # fp32 activations and parameters, as the course trains
TOKENS = 8192  # tokens each GPU computes per step (e.g. 2 sequences of 4096), as notebook 12 assumes
SHAPES = {125e6: (12, 768), 1e9: (20, 2048), 7e9: (32, 4096), 70e9: (80, 8192)}  # (layers, width): GPT-2 small;
# 1B fitted (12 L W^2 = 1.007e9, not a published shape); Llama 2's 7B and 70B. Notebook 12 prints these
RULE = ("of the layouts that fit, the fewest bytes between nodes; a pipeline only when nothing else fits (its "
        "bubble costs compute time the bytes do not show); on a tie, the simpler layout; HSDP only across nodes")


@dataclass
class Layout:
    name: str
    mesh: str  # the device mesh, e.g. "16 x 8 (replicate, shard)"
    gb_per_gpu: float  # model states per GPU
    fits: bool
    intra_bytes: float  # sent per GPU and step over the node's links
    inter_bytes: float  # sent per GPU and step between nodes
    note: str = ""
    bubble: float = 0.0  # share of each GPU's compute time idle in the pipeline's bubble
    same_as: str = ""  # the simpler layout this row equals here (HSDP on one node: FSDP2); pick skips it


def shape(psi: float) -> tuple[int, int]:
    """(layers, width) of a transformer of about ``psi`` parameters: ``SHAPES``' entry for a size listed there,
    else width = 128 x layers (12 L W^2 = psi)."""
    if psi in SHAPES:
        return SHAPES[psi]
    layers = max(1, round((psi / (12 * 128 ** 2)) ** (1 / 3)))
    return layers, 128 * layers


def fsdp_bytes(psi: float, n: int, gathers: int = 2) -> float:
    """Bytes one rank sends per step for FSDP over n ranks: ``gathers`` all-gathers of the parameters (forward
    and backward; 1 inside a pipeline stage, see the module docstring) and one reduce-scatter of the gradients."""
    return gathers * SENT["all-gather"](BYTES * psi, n) + SENT["reduce-scatter"](BYTES * psi, n) if n > 1 else 0.0


def tp_bytes(tp: int, tokens: float, width: int, layers: int) -> float:
    """Bytes one rank of a tensor-parallel group of ``tp`` sends per step for ``layers`` blocks of notebook 10's
    GPT computing ``tokens`` tokens together (no sequence parallelism): ``comm_count.predict_block``'s
    all-reduces of one activation each, in rings."""
    if tp <= 1:
        return 0.0
    block = predict_block(int(tokens), width, sequence_parallel=False, bytes_per=BYTES)
    return layers * sum(bytes_sent(kinds, tp) for kinds in block.values())


def pp_bytes(stages: int, tokens: float, width: int) -> float:
    """Bytes the busiest rank of a pipeline of ``stages`` sends per step for a replica's ``tokens`` tokens:
    a middle stage sends the activations forward and their gradients back; with 2 stages each sends one way."""
    if stages <= 1:
        return 0.0
    return (2 if stages > 2 else 1) * tokens * width * BYTES


def bubble(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe or 1F1B step (notebook 11): (p - 1)/(m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def layouts(psi: float, gpu_gb: float, gpus_per_node: int, nodes: int, tokens: int = TOKENS,
            width: int | None = None, layers: int | None = None, microbatches: int | None = None,
            headroom: float = 0.8) -> list[Layout]:
    """Five layouts of ``nodes`` x ``gpus_per_node`` GPUs for ``psi`` parameters, simplest first (see the module
    docstring for what each counts)."""
    g, r = gpus_per_node, nodes
    n = g * r
    layers, width = layers or shape(psi)[0], width or shape(psi)[1]
    limit = headroom * gpu_gb * GB
    sharded = model_states(predict(psi, n)["FSDP2"])  # 16 psi / N: what FSDP2, FSDP2 x TP and x PP hold
    ddp, hsdp = model_states(predict(psi, n)["DDP"]), model_states(predict(psi, g)["FSDP2"])
    crosses = "; its rings cross nodes" if r > 1 else ""

    ddp_sent = SENT["all-reduce"](BYTES * psi, n)
    rows = [
        Layout("DDP", f"{n} (replicate)", ddp / GB, ddp <= limit, ddp_sent if r == 1 else 0.0,
               ddp_sent if r > 1 else 0.0, "every GPU holds everything" + crosses),
        Layout("HSDP", f"{r} x {g} (replicate, shard)", hsdp / GB, hsdp <= limit, fsdp_bytes(psi, g),
               SENT["all-reduce"](BYTES * psi / g, r) if r > 1 else 0.0,
               "sharded inside a node" + (f"; 1/{g} of the gradients all-reduced across nodes" if r > 1
                                          else "; on one node the same as FSDP2"),
               same_as="" if r > 1 else "FSDP2"),
        Layout("FSDP2", f"{n} (shard)", sharded / GB, sharded <= limit, fsdp_bytes(psi, n) if r == 1 else 0.0,
               fsdp_bytes(psi, n) if r > 1 else 0.0, "sharded over every GPU" + crosses),
    ]
    tp_sent = tp_bytes(g, g * tokens, width, layers)  # a TP group of g computes g x tokens tokens together
    rows.append(Layout("FSDP2 x TP", f"{r} x {g} (dp, tp)", sharded / GB, sharded <= limit,
                       tp_sent, fsdp_bytes(psi / g, r),
                       f"TP's activations {tp_sent / GB:.1f} GB in the node"
                       + (f"; FSDP2 on 1/{g} of the parameters across nodes" if r > 1 else "")))
    pp, dp = (r, g) if r > 1 else (g, 1)  # stages across the nodes; on one node, across its GPUs
    m = microbatches or 4 * pp
    pp_sent = pp_bytes(pp, pp * tokens, width)  # a pipeline replica of pp GPUs computes pp x tokens tokens
    idle = bubble(pp, m)
    rows.append(Layout("FSDP2 x PP", f"{pp} x {dp} (pp, dp)", sharded / GB, sharded <= limit,
                       fsdp_bytes(psi / pp, dp, gathers=1) + (pp_sent if r == 1 else 0.0), pp_sent if r > 1 else 0.0,
                       f"{pp} stages, m = {m}: bubble {idle:.0%} of compute; activations "
                       + ("between nodes" if r > 1 else "inside the node"), bubble=idle))
    return rows


def pick(rows: list[Layout]) -> Layout | None:
    """``RULE``: of the layouts that fit, the one that sends the fewest bytes between nodes (the slow link), on a
    tie the earlier one in the table (less machinery); a layout with a pipeline bubble only when none without one
    fits (its idle compute is a cost the bytes do not show); never a row that equals a simpler one here (HSDP on
    one node). None if none fits."""
    fitting = [row for row in rows if row.fits and not row.same_as]
    free = [row for row in fitting if row.bubble == 0] or fitting
    return min(free, key=lambda row: row.inter_bytes) if free else None


def table(rows: list[Layout], intra_gbps: float = 450.0, inter_gbps: float = 50.0) -> str:
    """The layouts as text: memory, fit, bytes sent per GPU and step, and those bytes in milliseconds at the
    given bandwidths (GB/s per GPU; defaults: an NVLink-class node, a 400 Gb/s network); then the pick and its
    rule."""
    head = f"{'layout':<12}{'mesh':<28}{'GB/GPU':>8}  {'fits':<5}{'node GB':>9}{'ms':>7}{'network GB':>12}{'ms':>7}"
    speeds = f"{intra_gbps:g} GB/s per GPU inside a node, {inter_gbps:g} GB/s between nodes"
    lines = [f"ms = bytes / bandwidth: {speeds} (lower bounds, no overlap)", f"{head}  note"]
    for row in rows:
        lines.append(f"{row.name:<12}{row.mesh:<28}{row.gb_per_gpu:>8.1f}  {'yes' if row.fits else 'no':<5}"
                     f"{row.intra_bytes / GB:>9.2f}{1e3 * row.intra_bytes / (intra_gbps * GB):>7.0f}"
                     f"{row.inter_bytes / GB:>12.2f}{1e3 * row.inter_bytes / (inter_gbps * GB):>7.0f}  {row.note}")
    best = pick(rows)
    if best is None:
        lines.append("none fits: model states need more GPUs (no layout here holds less than 16 psi / N)")
        return "\n".join(lines)
    lines += [f"pick: {best.name} ({best.mesh})", f"the rule: {RULE}"]
    fewer = [row for row in rows if row.fits and row.bubble and row.inter_bytes < best.inter_bytes]
    for row in fewer:
        lines.append(f"{row.name} would send {row.inter_bytes / GB:.2f} GB between nodes instead of "
                     f"{best.inter_bytes / GB:.2f}, but leave each GPU idle {row.bubble:.0%} of its compute time "
                     "(the bubble): worth it when the network, not the compute, sets the pace")
    return "\n".join(lines)


def widget():
    """Sliders for the model, the tokens, the GPU and the cluster; each change prints ``table(layouts(...))``
    again, with the model's shape (``shape(psi)``) on the first line."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = {
        "psi": widgets.FloatLogSlider(value=7e9, base=10, min=8, max=12, step=0.05, description="parameters",
                                      readout_format=".2e"),
        "tokens": widgets.Dropdown(options=[1024, 2048, 4096, 8192, 16384, 32768], value=8192,
                                   description="tokens/GPU"),
        "gpu_gb": widgets.Dropdown(options=[24, 40, 80, 141, 192], value=80, description="GB per GPU"),
        "gpus_per_node": widgets.Dropdown(options=[1, 2, 4, 8], value=8, description="GPUs/node"),
        "nodes": widgets.IntSlider(value=4, min=1, max=256, description="nodes"),
        "intra_gbps": widgets.FloatText(value=450.0, description="node GB/s"),
        "inter_gbps": widgets.FloatText(value=50.0, description="network GB/s"),
    }

    def show(psi, tokens, gpu_gb, gpus_per_node, nodes, intra_gbps, inter_gbps):
        layers, width = shape(psi)
        print(f"a transformer of {psi:.3g} parameters: {layers} blocks of width {width}; {tokens} tokens per GPU "
              "per step")
        print(table(layouts(psi, gpu_gb, gpus_per_node, nodes, tokens=tokens), intra_gbps, inter_gbps))

    out = widgets.interactive_output(show, controls)
    display(widgets.VBox([widgets.HBox(list(controls.values())[:4]), widgets.HBox(list(controls.values())[4:]), out]))
