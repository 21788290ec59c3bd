"""Notebook 02's ring all-reduce stepper: the phases of a simulated ring shown as HTML tables or text lines.

The simulation itself lives in ``scripts/ring_allreduce.py`` (the notebook writes it); this module
only draws its phases, so it is given the phases and the per-rank counts of elements sent.
"""

RANK_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
WHAT = {"start": "each rank's own tensor, cut into N chunks",
        "reduce": "each rank sent one chunk to the next rank, which added it to its own copy",
        "all": "each rank passed one complete chunk to the next rank, which kept it"}


def chunk_text(chunk) -> str:
    return " ".join(f"{v:g}" for v in chunk.tolist())


def phase_html(phases: list[dict], k: int, sent: list[int]) -> str:
    """Phase k as a table, ranks x chunks; what was just received is highlighted. ``sent``: the elements
    each rank has sent up to and including phase k."""
    phase, n = phases[k], len(phases[k]["chunks"])
    received = {(dst, c): src for src, dst, c in phase["sends"]}
    cell = "padding:2px 8px;border:1px solid #ccc;text-align:center"
    rows = ["<tr><th></th>" + "".join(f"<th style='{cell}'>chunk {c}</th>" for c in range(n))
            + "<th style='padding:2px 8px'>elements sent so far</th></tr>"]
    for r, chunks in enumerate(phase["chunks"]):
        tds = []
        for c, chunk in enumerate(chunks):
            if (r, c) in received:
                how = "+=" if phase["name"].startswith("reduce") else "="
                tds.append(f"<td style='{cell};background:#E6E1F2;font-weight:bold'>{chunk_text(chunk)}"
                           f"<br><small>{how} from rank {received[(r, c)]}</small></td>")
            else:
                tds.append(f"<td style='{cell}'>{chunk_text(chunk)}</td>")
        rows.append(f"<tr><th style='color:{RANK_COLOURS[r % 6]};padding:2px 8px'>rank {r}</th>{''.join(tds)}"
                    f"<td style='text-align:center'>{sent[r]}</td></tr>")
    what = WHAT[phase["name"].split("-")[0]]
    return (f"<div style='font-family:monospace'><b>phase {k} of {len(phases) - 1}: {phase['name']}</b>"
            f" — {what}<table style='border-collapse:collapse;margin-top:4px'>{''.join(rows)}</table></div>")


def phase_lines(phases: list[dict]) -> list[str]:
    """Every phase as one text line (chunks separated by |), for readers of a saved notebook."""
    return [f"{k} {phase['name']:<19}" + "  ".join(f"r{r}: " + "|".join(chunk_text(c) for c in chunks)
                                                   for r, chunks in enumerate(phase["chunks"]))
            for k, phase in enumerate(phases)]


def stepper(phases_for, elements_sent, length: int = 8, ranks: int = 4):
    """Two sliders (ranks N, phase) over ``phases_for(n, length)``; needs a live kernel. Returns the widget."""
    import ipywidgets as widgets
    from IPython.display import HTML, display

    ranks_slider = widgets.IntSlider(value=ranks, min=2, max=6, description="ranks N")
    phase_slider = widgets.IntSlider(value=0, min=0, max=2 * (ranks - 1), description="phase")
    ranks_slider.observe(lambda change: setattr(phase_slider, "max", 2 * (change["new"] - 1)), names="value")

    def draw(n, k):
        phases = phases_for(n, length)
        display(HTML(phase_html(phases, k, elements_sent(phases[:k + 1]))))

    shown = widgets.interactive_output(draw, {"n": ranks_slider, "k": phase_slider})
    return widgets.VBox([widgets.HBox([ranks_slider, phase_slider]), shown])
