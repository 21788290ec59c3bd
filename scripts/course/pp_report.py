"""Notebook 11's tables and drawings, from course.bubble's numbers: the schedules' table, each rank's timeline
(measured and replayed), the bubble against m, the activations each schedule holds; and the figure
``notebooks/figures/11_bubble.svg`` (``bubble_svg``), drawn from the schedules' own order, not by hand.

    rows = {r["config"]: r for r in bubble.summarise(metrics)}
    print_table(rows)                     # predicted, replayed and measured idle share per configuration
    draw_timelines(metrics, rows, keys)   # per configuration: one real step, and the same order replayed
    draw_sweep(rows, p)                   # idle share against m: formula, replay, clock
    print_memory(rows, p)                 # micro-batches in flight and activation bytes, against GPipe
    python -m course.pp_report            # rewrite notebooks/figures/11_bubble.svg
"""

from __future__ import annotations

from course.bubble import KINDS, draw, predicted_bubble, predicted_in_flight, replay, step_window


def print_table(rows: dict) -> None:
    """One line per configuration: stages, the bubble predicted, replayed, measured (median, range), waits."""
    print(f"{'configuration':<22}{'stages':>7}{'predicted':>11}{'replayed':>10}{'measured (range)':>22}"
          f"{'in waits':>10}{'grad diff':>11}")
    for key, r in rows.items():
        predicted = f"{r['predicted']:.1%}" if r["predicted"] is not None else "-"
        print(f"{key:<22}{r['stages']:>7}{predicted:>11}{r['replayed']:>10.1%}"
              f"{r['measured']:>10.1%} ({r['measured_low']:.0%}-{r['measured_high']:.0%}){r['wait']:>10.1%}"
              f"{r['grad_diff']:>11.1e}")


def draw_timelines(metrics: dict, rows: dict, keys: list[str]):
    """Per configuration, left: one real step (the round with the median step time); right: the same order
    replayed with ideal times."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 2, figsize=(15, 2.3 * len(keys)))
    for (ax_clock, ax_slots), key in zip(axes, keys):
        ranks = {int(r): v for r, v in metrics["runs"][key]["ranks"].items()}
        windows = {r: v["windows"] for r, v in ranks.items()}
        events = {r: v["events"] for r, v in ranks.items()}
        steps_ms = rows[key]["step_ms"]
        median_round = sorted(range(len(steps_ms)), key=steps_ms.__getitem__)[len(steps_ms) // 2]
        window = step_window(windows, median_round)
        draw(events, window, ax=ax_clock, title=f"{key}: measured, idle {rows[key]['measured']:.0%} (median round)")
        idle, slots = replay(events, window, rows[key]["stages"])
        end = max(e for evs in slots.values() for _, _, e, _, _ in evs)
        formula = f" (formula {rows[key]['predicted']:.0%})" if rows[key]["predicted"] is not None else ""
        draw(slots, (0, end), ax=ax_slots, scale=1, xlabel="slots (forward = 1)",
             title=f"{key}: the schedule alone, idle {sum(idle.values()) / len(idle):.0%}{formula}")
    fig.tight_layout()
    return fig


def draw_sweep(rows: dict, p: int, on_gpus: bool = False):
    """The idle share against the number of micro-batches: the formula, the replay, the clock (median, range)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    top = max(r["m"] for r in rows.values())
    ms = range(1, top + 1)
    ax.plot(ms, [predicted_bubble(p, m) for m in ms], color="#444", label="predicted (p - 1)/(m + p - 1)")
    for schedule, colour in (("gpipe", "#4C72B0"), ("1f1b", "#DD8452")):
        sweep = [r for r in rows.values() if r["schedule"] == schedule]
        x = [r["m"] for r in sweep]
        ax.plot(x, [r["replayed"] for r in sweep], "o", color=colour, label=f"{schedule}: the schedule alone")
        ax.errorbar(x, [r["measured"] for r in sweep], fmt="s--", color=colour, alpha=0.6,
                    yerr=[[r["measured"] - r["measured_low"] for r in sweep],
                          [r["measured_high"] - r["measured"] for r in sweep]],
                    label=f"{schedule}: measured (median, range)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle share of a step")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"The bubble on {p} stages ({'GPU' if on_gpus else 'CPU'} ranks)")
    fig.tight_layout()
    return fig


def print_memory(rows: dict, p: int) -> None:
    """GPipe and 1F1B per rank: micro-batches in flight (predicted, measured) and the activations held, against
    GPipe's at the same m; then what the interleaved schedules held."""
    print(f"{'configuration':<22}{'rank':>5}{'in flight: predicted':>22}{'measured':>10}{'activations MB':>16}"
          f"{'vs GPipe: predicted':>21}{'measured':>10}")
    for key, r in rows.items():
        if r["schedule"] not in ("gpipe", "1f1b"):
            continue
        for rank, held in r["in_flight"].items():
            gpipe = rows[f"gpipe m={r['m']}"]["activation_bytes"][rank]
            predicted = predicted_in_flight(r["schedule"], p, r["m"], rank)
            print(f"{key:<22}{rank:>5}{predicted:>22}{held:>10}{r['activation_bytes'][rank] / 1e6:>16.2f}"
                  f"{predicted / r['m']:>21.2f}{r['activation_bytes'][rank] / gpipe:>10.2f}")
    for key, r in rows.items():
        if r["schedule"] in ("gpipe", "1f1b"):
            continue
        print(f"{key:<22} activations held per rank (MB): "
              + ", ".join(f"rank {k} {v / 1e6:.2f}" for k, v in r["activation_bytes"].items())
              + f"; chunks in flight at most: {r['in_flight']}")


# ------------------------------------------------------------------------------------------ the figure 11_bubble


def schedule_order(schedule: str, p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) chunks rank ``rank`` runs in one step: GPipe all forwards then all backwards;
    1F1B (torch's Schedule1F1B) min(m, p - rank) forwards, then one backward and one forward in turn."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, p - rank)
    order, f, b = [("F", i) for i in range(warm)], warm, 0
    while b < m:
        order.append(("B", b))
        b += 1
        if f < m:
            order.append(("F", f))
            f += 1
    return order


def in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and whose backward has not: the activations a rank holds."""
    held = most = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def bubble_svg(p: int = 4, m: int = 8, slot: float = 21.0) -> str:
    """The figure: one batch, GPipe and 1F1B on ``p`` ranks, forward 1 slot, backward 2, sends free; each panel's
    idle share from the ideal replay and each rank's activations held at most, at the end of its lane."""
    panels = [("One batch, no micro-batches", "gpipe", 1), ("GPipe: all forwards, then all backwards", "gpipe", m),
              ("1F1B: after the warm-up, one forward and one backward in turn", "1f1b", m)]
    left, width, lane, gap = 70, 120 + (m + p - 1) * 3 * slot, 24, 6
    height = 80 + len(panels) * (34 + p * (lane + gap) + 14)
    held_text = {}
    parts, y = [], 70
    for title, schedule, mb in panels:
        events = {r: [(kind, float(i), i + 0.5, r, b) for i, (kind, b) in enumerate(schedule_order(schedule, p, mb, r))]
                  for r in range(p)}
        idle, slots = replay(events, (0.0, 1e9), p)
        held = {r: in_flight(schedule_order(schedule, p, mb, r)) for r in range(p)}
        held_text[(schedule, mb)] = held
        share = sum(idle.values()) / p
        parts.append(f'<text x="{left}" y="{y}" font-size="14" font-weight="bold" fill="#222">{title}</text>')
        parts.append(f'<text x="{width + left - 10:.0f}" y="{y}" font-size="12" text-anchor="end" fill="#444">'
                     f"m = {mb}: idle {share:.0%} = (p-1)/(m+p-1) = {p - 1}/{mb + p - 1}</text>")
        end = max(e for evs in slots.values() for _, _, e, _, _ in evs)
        for r in range(p):
            top = y + 12 + r * (lane + gap)
            parts.append(f'<text x="{left - 8}" y="{top + 16}" font-size="12" text-anchor="end" fill="#222">rank {r}</text>')
            parts.append(f'<rect x="{left}" y="{top}" width="{end * slot:.1f}" height="{lane}" fill="#F2F2F2"/>')
            for kind, s, e, _, b in slots[r]:
                colour = KINDS[kind][1]
                parts.append(f'<rect x="{left + s * slot:.1f}" y="{top}" width="{(e - s) * slot:.1f}" height="{lane}" '
                             f'fill="{colour}" stroke="#FFFFFF" stroke-width="1"/>')
                parts.append(f'<text x="{left + (s + e) / 2 * slot:.1f}" y="{top + 16}" font-size="10" '
                             f'text-anchor="middle" fill="{"#FFFFFF" if kind == "B" else "#222"}">{kind}{b}</text>')
            parts.append(f'<text x="{left + end * slot + 10:.1f}" y="{top + 16}" font-size="12" fill="#222">holds '
                         f"{held[r]} micro-batch{'es' if held[r] > 1 else ''}</text>")
        y += 34 + p * (lane + gap) + 14
    gpipe, onef = held_text[("gpipe", m)], held_text[("1f1b", m)]
    alt = (f"Pipeline schedules on {p} ranks with {m} micro-batches, a forward taking one slot and a backward two: "
           f"one batch leaves each rank idle {predicted_bubble(p, 1):.0%} of the time; GPipe and 1F1B are both idle "
           f"{p - 1}/{m + p - 1} of the time, but GPipe's rank 0 holds the activations of all {gpipe[0]} micro-batches "
           f"at once while 1F1B's holds at most {onef[0]} (rank r: p - r), the last rank "
           f"{onef[p - 1]}")
    total = width + left + 110
    head = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{total:.0f}" height="{height}" '
            f'viewBox="0 0 {total:.0f} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">'),
            f"<title>{alt}</title>", f'<rect x="0" y="0" width="{total:.0f}" height="{height}" fill="#FFFFFF"/>',
            (f'<text x="{total / 2:.1f}" y="26" text-anchor="middle" font-size="16" font-weight="bold" fill="#222">'
            f"The bubble and the memory: {p} stages, forward = 1 slot, backward = 2 slots, sends free</text>"),
            (f'<text x="{total / 2:.1f}" y="46" text-anchor="middle" font-size="12" fill="#444">F3 = forward of '
            "micro-batch 3 (light), B3 its backward (dark), grey = idle; at the right, the micro-batches whose "
            "activations each rank holds at most</text>")]
    return "\n".join(head + parts + ["</svg>"]) + "\n"


if __name__ == "__main__":
    from course import ROOT

    (ROOT / "notebooks" / "figures" / "11_bubble.svg").write_text(bubble_svg())
    print("wrote notebooks/figures/11_bubble.svg")
