"""Notebook 00's first cell: ``course.hardware.describe()`` printed as a short, readable report."""

import course
from course.hardware import describe


def report_lines(hw: dict) -> list[tuple[str, str]]:
    """describe()'s fields as (name, value) lines; a backend is reported as usable or not, not as True/False."""
    hw = dict(hw)
    gpus = hw.pop("accelerator_count", 0) or 0
    accelerator = hw.pop("accelerator", None)
    names = hw.pop("device_names", [])
    lines = [("torch", str(hw.pop("torch", ""))), ("CPU cores", str(hw.pop("cpu_cores", "?")))]
    lines.append(("accelerator", f"{accelerator} × {gpus}" + (f" ({', '.join(names)})" if names else "")
                  if accelerator and gpus else "none: every process will run on the CPU"))
    for name in ("gloo", "nccl"):
        built = hw.pop(f"{name}_built", hw.pop(name, None))  # compiled into this PyTorch
        usable = hw.pop(f"{name}_usable", None)  # ... and usable on this hardware
        if name == "nccl" and usable is None:
            usable = bool(built) and accelerator == "cuda" and gpus > 0
        if built is None:
            continue
        if not built:
            lines.append((name, "not in this build of PyTorch"))
        elif name == "gloo":
            lines.append((name, "available: moves CPU tensors between processes (over TCP)"))
        elif usable:
            lines.append((name, f"available, and usable here: {gpus} GPU(s)"))
        else:
            lines.append((name, "available in this build, usable only with GPUs" + ("" if gpus else " (none here)")))
    lines += [(key, str(value)) for key, value in hw.items()]  # any other field, as describe() gives it
    return lines


def print_report(hw: dict | None = None) -> list[tuple[str, str]]:
    """Print this machine's report (or ``hw``'s), with the quick-mode switch; return its lines."""
    lines = report_lines(describe() if hw is None else hw)
    for key, value in [*lines, ("quick mode", f"{course.QUICK}  (COURSE_QUICK=1 makes every run short)")]:
        print(f"{key:>12}: {value}")
    return lines
