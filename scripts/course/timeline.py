"""Per-rank timelines from torch.profiler's Chrome trace JSON (notebook 05): what each rank did when, and how
much of its gradient communication ran while it was still computing.

    timelines = load_timelines("runs/05_performance/step_resnet18/trace")   # {rank: Timeline}
    timelines[0].overlap_fraction()      # share of all-reduce time that ran during backward compute
    draw(timelines)                      # a matplotlib figure: one lane per rank and activity

What is read (names as torch 2.14 writes them):
- ``forward`` / ``backward`` / ``optimizer``: the ``record_function`` spans the training step opens.
- compute inside backward: the autograd engine's ``autograd::engine::evaluate_function: ...`` ops on CPU,
  less the ``c10d::`` calls inside them that hand a bucket to the backend; GPU kernels (other than the
  collectives') with an accelerator. The backward span itself also holds the wait for the last
  bucket's all-reduce, so it is not counted as compute. On CPU, all-reduce spans are clipped to the
  backward spans (DDP waits for them there; a gloo span's completion callbacks can run on later).
- communication: ``gloo:all_reduce`` / ``nccl:all_reduce`` ... spans (gloo runs them on its own threads, for
  their real duration) or, with a GPU, the collective kernels; buffer broadcasts are drawn but not counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from course import in_repo

STEP_PHASES = ("forward", "backward", "optimizer")
COLLECTIVE = re.compile(r"^(gloo|nccl|xccl|ucc|mpi):(\w+)$")
COLOURS = {"forward": "#9DB7DA", "backward": "#4C72B0", "optimizer": "#AAAAAA", "all-reduce": "#8172B3",
           "broadcast": "#C9B8E8"}
Intervals = list[tuple[float, float]]


def merge(intervals: Intervals) -> Intervals:
    """Sorted, non-overlapping intervals covering the same time."""
    out: Intervals = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: Intervals) -> float:
    return sum(end - start for start, end in merge(intervals))


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The time covered by both ``a`` and ``b``."""
    a, b, out, i, j = merge(a), merge(b), [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The time covered by ``a`` but not by ``b``."""
    out = []
    for start, end in merge(a):
        for cut_start, cut_end in merge(b):
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


@dataclass
class Timeline:
    """One rank's trace as intervals in milliseconds (absolute, so that ranks of one machine line up)."""

    rank: int
    spans: dict[str, Intervals] = field(default_factory=dict)  # forward, backward, optimizer, all-reduce, ...
    compute: Intervals = field(default_factory=list)  # compute inside backward (see the module docstring)

    def busy(self, kind: str) -> float:
        """Milliseconds spent in ``kind`` (overlapping spans counted once)."""
        return total(self.spans.get(kind, []))

    def overlap_fraction(self) -> float | None:
        """Share of all-reduce time during which this rank was also computing its backward pass."""
        comm = self.spans.get("all-reduce", [])
        if not comm:
            return None
        return total(intersect(comm, self.compute)) / total(comm)

    def summary(self) -> dict:
        comm = self.busy("all-reduce")
        overlap = self.overlap_fraction()
        return {"rank": self.rank, **{f"{k}_ms": round(self.busy(k), 2) for k in self.spans},
                "backward_compute_ms": round(total(self.compute), 2),
                "all_reduce_overlapped_ms": round(comm * overlap, 2) if overlap is not None else None,
                "overlap_fraction": overlap}


def load_timeline(path: str | Path) -> Timeline:
    """Read one rank's Chrome trace (``prof.export_chrome_trace``)."""
    trace = json.loads(Path(path).read_text())
    rank = int(trace.get("distributedInfo", {}).get("rank", _rank_from_name(Path(path))))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    spans: dict[str, Intervals] = {}
    on_gpu = any(e.get("cat") == "kernel" for e in events)
    compute, backward, launches = [], [], []
    for e in events:
        interval = (e["ts"] / 1000, (e["ts"] + e["dur"]) / 1000)
        name, cat = e["name"], e.get("cat", "")
        collective = COLLECTIVE.match(name)
        if cat == "user_annotation" and name in STEP_PHASES:
            spans.setdefault(name, []).append(interval)
            if name == "backward":
                backward.append(interval)
        elif collective and not on_gpu:
            kind = "all-reduce" if collective.group(2) in ("all_reduce", "allreduce") else collective.group(2)
            spans.setdefault(kind, []).append(interval)
        elif on_gpu and cat == "kernel":
            if "nccl" in name.lower():
                kind = "all-reduce" if "allreduce" in name.lower().replace("_", "") else "broadcast"
                spans.setdefault(kind, []).append(interval)
            else:
                compute.append(interval)
        elif not on_gpu and name.startswith("autograd::engine::evaluate_function:"):
            compute.append(interval)
        elif not on_gpu and name.startswith("c10d::"):
            launches.append(interval)  # handing a bucket to the backend: inside backward, but not compute
    if not on_gpu and backward:
        compute = subtract(intersect(compute, backward), launches)
        # DDP waits for every bucket before backward() returns; a gloo span can end a little later (its
        # completion callbacks), into the next step. Clip it to the backward it belongs to.
        spans["all-reduce"] = [(start, min(end, next((b for a, b in backward if a <= start < b), end)))
                               for start, end in spans.get("all-reduce", [])]
    compute = merge(compute)
    return Timeline(rank, {k: merge(v) for k, v in spans.items()}, compute)


def load_timelines(folder: str | Path) -> dict[int, Timeline]:
    """Every ``*.json`` trace of a folder, by rank."""
    found = {}
    for path in sorted(in_repo(folder).glob("*.json")):
        timeline = load_timeline(path)
        found[timeline.rank] = timeline
    if not found:
        raise FileNotFoundError(f"no Chrome trace (*.json) in {folder}")
    return dict(sorted(found.items()))


def draw(timelines: dict[int, Timeline], ax=None, title: str = "Per-rank timeline"):
    """Two lanes per rank: the step phases (backward compute darker) and the communication."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(timelines)))
    origin = min(start for t in timelines.values() for spans in t.spans.values() for start, _ in spans)
    lanes = []
    for rank, t in timelines.items():
        y_step = 2 * (len(timelines) - len(lanes) // 2) - 1  # rank 0 on top
        y_comm = y_step - 1
        lanes += [(y_step, f"rank {rank} step"), (y_comm, f"rank {rank} comm")]
        for kind in ("forward", "backward", "optimizer"):
            bars = [(s - origin, e - s) for s, e in t.spans.get(kind, [])]
            ax.broken_barh(bars, (y_step - 0.35, 0.7), facecolors=COLOURS[kind], edgecolor="none",
                           alpha=0.45 if kind == "backward" else 1.0)
        ax.broken_barh([(s - origin, e - s) for s, e in t.compute], (y_step - 0.35, 0.7),
                       facecolors=COLOURS["backward"], edgecolor="none")
        for kind in ("broadcast", "all-reduce"):
            ax.broken_barh([(s - origin, e - s) for s, e in t.spans.get(kind, [])], (y_comm - 0.35, 0.7),
                           facecolors=COLOURS[kind], edgecolor="#333333", linewidth=0.3)
    ax.set_yticks([y for y, _ in lanes], [label for _, label in lanes])
    ax.set_xlabel("time since the first traced event (ms)")
    ax.set_title(title)
    from matplotlib.patches import Patch

    legend = [Patch(color=COLOURS[k], label=k) for k in ("forward", "optimizer", "all-reduce", "broadcast")]
    legend.insert(1, Patch(color=COLOURS["backward"], label="backward: compute"))
    legend.insert(2, Patch(color=COLOURS["backward"], alpha=0.45, label="backward: not computing"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax.figure


def _rank_from_name(path: Path) -> int:
    digits = re.findall(r"\d+", path.stem)
    return int(digits[-1]) if digits else 0
