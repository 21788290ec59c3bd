"""The pipeline bubble (notebook 11): predicted from p and m, and measured from each rank's timeline.

    predicted_bubble(p=2, m=4)            # 0.2: (p - 1) / (m + p - 1), GPipe and 1F1B alike
    # every rank's events, recorded by course.pp_recorder.StageRecorder and gathered:
    idle_fraction(events_by_rank, window) # {rank: share of the step window it did no compute}
    draw(events_by_rank, ax=ax)           # one lane per rank: forward, backward, weight grad, waits, idle

The prediction assumes every stage takes the same time for a micro-batch's forward (and for its backward) and
that sending costs nothing: with p stages and m micro-batches a step lasts m + p - 1 slots per direction and
each rank computes in m of them. The measurement: a step's window runs from the first rank's start to the last
rank's end (one machine: one clock); a rank is busy while it runs a forward, backward or weight-gradient
chunk; everything else is idle (waiting for a neighbour, the schedule's own Python, sending).
"""

from __future__ import annotations

import statistics

KINDS = {"F": ("forward", "#9DB7DA"), "B": ("backward", "#4C72B0"), "W": ("weight gradient", "#55A868"),
         "wait": ("waiting for send/recv", "#DD8452")}


def predicted_bubble(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B step with ``p`` equal stages and ``m`` micro-batches, sends free."""
    return (p - 1) / (m + p - 1)


def predicted_interleaved_bubble(p: int, m: int, v: int) -> float:
    """The same with ``v`` stages per rank (interleaved 1F1B, Narayanan et al. 2021): the fill and drain slots
    are v times shorter, so the idle share is (p - 1) / (v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def predicted_in_flight(schedule: str, p: int, m: int, rank: int) -> int:
    """Micro-batches whose activations a rank holds at most: GPipe all m, 1F1B at most p - rank (warm-up)."""
    return m if schedule == "gpipe" else min(m, p - rank)


def _merged_busy(events, start, end, kinds=("F", "B", "W")) -> float:
    spans = sorted((max(s, start), min(e, end)) for k, s, e, *_ in events if k in kinds and e > start and s < end)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


def idle_fraction(events_by_rank: dict[int, list], window: tuple[float, float]) -> dict[int, float]:
    """Each rank's share of ``window`` (one step, all ranks) in which it ran no forward, backward or W chunk."""
    start, end = window
    return {rank: 1 - _merged_busy(ev, start, end) / (end - start) for rank, ev in events_by_rank.items()}


def wait_fraction(events_by_rank: dict[int, list], window: tuple[float, float]) -> dict[int, float]:
    """Each rank's share of ``window`` spent inside a send/recv wait."""
    start, end = window
    return {rank: _merged_busy(ev, start, end, ("wait",)) / (end - start) for rank, ev in events_by_rank.items()}


def step_window(windows_by_rank: dict[int, list], step: int) -> tuple[float, float]:
    """Step ``step``'s window over all ranks: the first start to the last end."""
    return (min(w[step][0] for w in windows_by_rank.values()), max(w[step][1] for w in windows_by_rank.values()))


def replay(events_by_rank: dict[int, list], window: tuple[float, float], num_stages: int):
    """The schedule alone: each rank's chunks in the order it ran them, with ideal times (a forward 1/v, a
    backward 2/v, or 1/v input gradient + 1/v weight gradient when the schedule splits it; v stages per rank)
    and free sends. Returns (idle share per rank, the replayed events in slot units) -- CPU noise removed."""
    v = num_stages // len(events_by_rank)
    todo = {r: sorted((e for e in ev if e[0] in ("F", "B", "W") and window[0] <= e[1] < window[1]),
                      key=lambda e: e[1]) for r, ev in events_by_rank.items()}
    split = {r: any(e[0] == "W" for e in t) for r, t in todo.items()}
    done: dict[tuple[str, int, int], float] = {}
    free, busy, out = dict.fromkeys(todo, 0.0), dict.fromkeys(todo, 0.0), {r: [] for r in todo}
    while any(todo.values()):
        progressed = False
        for r, queue in todo.items():
            while queue:
                kind, _, _, stage, mb = queue[0]
                deps = {"F": [("F", stage - 1, mb)] if stage > 0 else [],
                        "B": [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < num_stages - 1 else []),
                        "W": [("B", stage, mb)]}[kind]
                if any(d not in done for d in deps):
                    break
                length = (2.0 if kind == "B" and not split[r] else 1.0) / v
                start = max([free[r]] + [done[d] for d in deps])
                done[(kind, stage, mb)] = free[r] = start + length
                busy[r] += length
                out[r].append((kind, start, start + length, stage, mb))
                queue.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("the recorded order cannot be replayed: a chunk waits for one that never ran")
    end = max(free.values())
    return {r: 1 - busy[r] / end for r in todo}, out


def summarise(metrics: dict) -> list[dict]:
    """One row per configuration of pp_schedules.py's metrics.json: bubble predicted, of the schedule alone
    (replayed), measured (median and range over rounds), waits, step time, activations held; and where a rank's
    step went (medians over rounds of the mean over ranks, ms): computing chunks, inside send/recv waits, and
    the rest (the schedule's own Python between chunks)."""
    rows = []
    for key, run in metrics["runs"].items():
        ranks = {int(r): v for r, v in run["ranks"].items()}
        first = ranks[min(ranks)]
        p, m, n = len(ranks), first["m"], first["stages"]
        windows = {r: v["windows"] for r, v in ranks.items()}
        events = {r: v["events"] for r, v in ranks.items()}
        measured, waits, steps, replayed, parts = [], [], [], [], []
        for i in range(len(first["windows"])):
            w = step_window(windows, i)
            measured.append(sum(idle_fraction(events, w).values()) / p)
            waits.append(sum(wait_fraction(events, w).values()) / p)
            steps.append((w[1] - w[0]) * 1e3)
            replayed.append(sum(replay(events, w, n)[0].values()) / p)
            compute, wait = 1 - measured[-1], waits[-1]
            parts.append((compute * steps[-1], wait * steps[-1], (1 - compute - wait) * steps[-1]))
        v = n // p
        rows.append({"config": key, "schedule": first["schedule"], "m": m, "stages": n,
                     "predicted": None if first["schedule"] == "zerobubble" else  # it fills the bubble
                     predicted_bubble(p, m) if v == 1 else predicted_interleaved_bubble(p, m, v),
                     "replayed": statistics.median(replayed), "measured": statistics.median(measured),
                     "measured_low": min(measured), "measured_high": max(measured),
                     "wait": statistics.median(waits), "step_ms": steps,
                     **{f"{part}_ms": statistics.median(x[k] for x in parts)
                        for k, part in enumerate(("compute", "wait", "other"))},
                     "activation_bytes": {r: max(v["peak_activation_bytes"]) for r, v in ranks.items()},
                     "in_flight": {r: max(v["peak_in_flight"]) for r, v in ranks.items()},
                     "grad_diff": max(v["grad_diff"] for v in ranks.values())})
    return rows


def draw(events_by_rank: dict[int, list], window: tuple[float, float], ax=None, title: str = "", scale: float = 1e3,
         xlabel: str = "ms since the step began"):
    """One lane per rank over one step's window: F, B, W chunks (labelled with the micro-batch), waits, idle.
    scale: x units per second of the events (1e3: milliseconds; 1 for replayed slots)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * len(events_by_rank)))
    start, end = window
    ranks = sorted(events_by_rank)
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row  # rank 0 on top
        ax.broken_barh([(0, (end - start) * scale)], (y - 0.4, 0.8), facecolors="#F2F2F2", edgecolor="none")
        for kind, s, e, stage, mb in events_by_rank[rank]:
            if e <= start or s >= end:
                continue
            left, width = (max(s, start) - start) * scale, (min(e, end) - max(s, start)) * scale
            height = (y - 0.15, 0.3) if kind == "wait" else (y - 0.4, 0.8)
            ax.broken_barh([(left, width)], height, facecolors=KINDS[kind][1], edgecolor="white", linewidth=0.4)
            if kind != "wait" and width > (end - start) * scale / 60:
                ax.text(left + width / 2, y, str(mb), ha="center", va="center", fontsize=7,
                        color="white" if kind == "B" else "black")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_xlim(0, (end - start) * scale)
    ax.set_xlabel(f"{xlabel} (numbers: micro-batch)")
    ax.set_title(title, fontsize=10)
    legend = [Patch(color=c, label=label) for label, c in KINDS.values()]
    legend.append(Patch(color="#F2F2F2", label="idle"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=5, fontsize=8, frameon=False)
    return ax.figure
