"""The job plumbing of the pitfall notebooks (04, 04b): launch a job that must fail, and print it in a few lines.

A failing job is shown by its key lines (the symptom, and the failing rank's own error); its whole
output is one click away in a collapsed block (``course.launcher.show_report``). Also here: the
``course.measure.Comparison`` a job saved in its metrics.json, and the environment of a simulated node.
"""

import re

from course.hardware import accelerator_count
from course.launcher import launch, plan, show_report
from course.measure import Comparison, Measurement

RUNS = "runs/04_pitfalls"  # every run of notebooks 04 and 04b goes under here
HANG_S = 10  # process-group timeout of the runs that hang: they end in seconds (the defaults: pitfall 7)
TAGS = re.compile(r"^(\[[^\]]*\]:? ?)+")  # the [rank0]: / [node 1] prefixes of each output line
SILENT = {"quiet": True, "on_line": lambda line: None}  # launch() options: keep the output, print nothing


def symptom(text: str, *needles: str, width: int = 220, limit: int = 8) -> list[str]:
    """Print (and return) the lines of a job's output that contain any of the needles: at most `limit`,
    cut at `width` characters, without the copies that torchrun's final report repeats."""
    found = [line for line in text.splitlines() if any(n in line for n in needles)]
    tagged = {TAGS.sub("", line).strip() for line in found if TAGS.match(line)}
    found = [line for line in found if TAGS.match(line) or line.strip() not in tagged]
    found = list(dict.fromkeys(found))  # each distinct line once
    print("SYMPTOM:", *[line if len(line) <= width else line[:width] + " [...]" for line in found[:limit]],
          sep="\n  ")
    if len(found) > limit:
        print(f"  ... {len(found) - limit} more such lines in the full output")
    return found


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
