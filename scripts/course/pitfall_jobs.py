"""The job plumbing of the pitfall notebooks (04, 04b): launch a job that must fail, and print it in a few lines.

A failing job is shown by its key lines (the symptom, and the failing rank's own error); its whole
output is one click away in a collapsed block (``course.launcher.show_report``). Also here: the
``course.measure.Comparison`` a job saved in its metrics.json, the environment of a simulated node, and the
readers of the lines the pitfall scripts print (so that the notebooks' cells carry no regular expressions).
"""

import re
import statistics

from course.hardware import accelerator_count
from course.launcher import launch, plan, show_report
from course.measure import MIN_ROUNDS, SAME_BAND, Comparison, Measurement

RUNS = "runs/04_pitfalls"  # every run of notebooks 04 and 04b goes under here
HANG_S = 10  # process-group timeout of the runs that hang: they end in seconds (the defaults: pitfall 7)
TAGS = re.compile(r"^(\[[^\]]*\]:? ?)+")  # the [rank0]: / [node 1] prefixes of each output line
SILENT = {"quiet": True, "on_line": lambda line: None}  # launch() options: keep the output, print nothing


def key_lines(text: str, *needles: str, label: str = "RESULT", width: int = 220, limit: int = 8) -> list[str]:
    """Print under ``label`` (and return) the lines of a job's output that contain any of the needles: at most
    `limit`, cut at `width` characters, without the copies that torchrun's final report repeats."""
    found = [line for line in text.splitlines() if any(n in line for n in needles)]
    tagged = {TAGS.sub("", line).strip() for line in found if TAGS.match(line)}
    found = [line for line in found if TAGS.match(line) or line.strip() not in tagged]
    found = list(dict.fromkeys(found))  # each distinct line once
    print(f"{label}:", *[line if len(line) <= width else line[:width] + " [...]" for line in found[:limit]],
          sep="\n  ")
    if len(found) > limit:
        print(f"  ... {len(found) - limit} more such lines in the full output")
    return found


def symptom(text: str, *needles: str, **options) -> list[str]:
    """``key_lines`` of a job that shows a pitfall, labelled SYMPTOM."""
    return key_lines(text, *needles, label="SYMPTOM", **options)


def report(result, *needles: str, **options) -> list[str]:
    """A finished job in a few lines: its exit code, the lines that show the symptom, the failing rank's own
    last error lines (result.failure), and the whole output one click away (show_report: collapsed)."""
    print(f"exit code {result.returncode}")
    found = symptom(result.output, *needles, **options)
    if result.failure and result.failure.startswith("rank"):  # a rank failed, not torchrun itself
        print("FAILING RANK:", result.failure)
    show_report(result)
    return found


def must_fail(script: str, nproc: int = 2, args=(), timeout: float = 120, **kwargs):
    """Launch a job that is expected to fail, without printing its output; return its result."""
    result = launch(script, nproc, args, check=False, timeout=timeout, **SILENT, **kwargs)
    assert result.returncode != 0, f"{script} {list(args)} was expected to fail, but it succeeded"
    return result


def comparison_from(saved: dict) -> Comparison:
    """The course.measure.Comparison that a job saved (Comparison.to_dict()) in its metrics.json."""
    return Comparison({name: Measurement(name, values) for name, values in saved["values"].items()},
                      saved["unit"], saved["higher_is_better"], cpu_only=plan(2).device == "cpu")


def reading(result: Comparison, name: str, baseline: str) -> str:
    """What a comparison showed, in one sentence computed from its numbers: the verdict of course.measure's rule
    when it decides ("Shown here: ..."), else what the median of the rounds suggests and why the rounds do not decide."""
    judged = result.judge(name, baseline)
    key, ratio = judged["key"], statistics.median(judged["ratios"]) if judged["ratios"] else float("nan")
    timing = result.unit.endswith("/s") or result.unit in ("s", "ms", "s/step")
    up, down = ("faster", "slower") if timing else ("higher", "lower")
    if not result.higher_is_better:
        up, down = down, up
    rounds = len(judged["ratios"])
    head = f"'{name}' at {ratio:.2f}x the {result.unit or 'value'} of '{baseline}' (median of the rounds)"
    if key in ("above", "below", "same"):
        word = {"above": up, "below": down, "same": "about the same"}[key]
        return f"Shown here: {head}: {word} in every one of {rounds} rounds."
    lean = up if ratio > 1 + SAME_BAND else down if ratio < 1 / (1 + SAME_BAND) else "about the same"
    why = (f"{rounds} round{'s' * (rounds != 1)} cannot decide (a verdict needs {MIN_ROUNDS} that agree)"
           if key in ("few", "none") else "its rounds do not agree beyond the noise (its verdict above says how)")
    return f"Not decided here: {head} suggests {lean}, but {why}."


def node_env(node: int) -> dict:
    """Environment of a simulated node: 1 CPU thread; its own GPU when there are 2+, else none (gloo)."""
    return {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": str(node) if accelerator_count() >= 2 else ""}


def setting() -> str:
    """One line: quick or full mode, GPUs, cores, and what 2 ranks use here."""
    import course
    from course.hardware import cpu_cores

    chosen = plan(2)
    return (f"{'quick' if course.QUICK else 'full'} mode; {accelerator_count()} GPU(s), {cpu_cores()} CPU cores; "
            f"2 ranks use {chosen.backend} on {chosen.device}" + (" (CPU numbers below)" if chosen.device == "cpu" else ""))


# ---------------------------------------------------------------- what the pitfall scripts print, read back

def device_reports(output: str) -> list[tuple[int, str, str, str]]:
    """pitfall_device.py's per-rank check: (rank, backend, device of the parameters, current GPU index)."""
    found = re.findall(r"rank (\d) \(local rank \d, (\w+)\): parameters on ([^,\s]+), current GPU index (.+)", output)
    return sorted((int(rank), backend, device, current.strip()) for rank, backend, device, current in found)


def first_indices(output: str, seed: int = 0, rank: int = 0) -> dict[str, list[str]]:
    """pitfall_set_epoch.py: the first indices one rank got in each epoch, "with" and "without" set_epoch."""
    found = re.findall(rf"\[(with|without) set_epoch, seed {seed}\] rank {rank} epoch \d+: first indices (\[.*?\])",
                       output)
    return {case: [indices for c, indices in found if c == case] for case in ("without", "with")}


def join_weight(output: str) -> float:
    """pitfall_uneven.py --fix join: how much of its own gradient DDP applied on the rank with an extra batch."""
    return float(re.search(r"DDP applied ([\d.]+) x", output)[1])


def print_rounds(line: str) -> None:
    """An on_line for launch(): show only a job's "round N: ..." progress lines, without their rank tag."""
    if re.search(r"round \d+:", line):
        print(TAGS.sub("", line), end="")
