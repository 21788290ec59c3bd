"""Which device and process-group backend the processes of a job use: one rule, for every accelerator.

The rule (``choose``), used by the runner, the doctor, and the course's launcher, scripts and notebooks alike
(``course.hardware`` gives a process its device by it):

- The backend for a device is PyTorch's own choice (``Backend.default_device_backend_map``:
  cuda -> nccl, xpu -> xccl, cpu -> gloo), used only where that backend can carry tensors of
  that device (``Backend.backend_capability``) and this build of PyTorch has it
  (``is_backend_available``: Windows builds have no nccl). PyTorch maps mps to gloo, but gloo
  carries only CPU and CUDA tensors (its collectives reject any other device type), so ranks on a
  Mac use the CPU with gloo, while a single plain process may use MPS.
- Ranks get an accelerator each (``<type>:LOCAL_RANK``) when there is one for every local process;
  otherwise every rank runs on the CPU with gloo. Two ranks sharing one GPU is a pitfall, not a plan.

Nothing here hard-codes ``cuda`` or ``nccl``; every decision comes with a reason to print.
torch is imported only when needed: the runner's own process can plan a CPU job without it.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

CPU_BACKEND = "gloo"  # PyTorch's default for "cpu" (a test checks it against the installed torch)
NAMES = {"cuda": "GPU", "xpu": "XPU", "mps": "MPS device", "hpu": "HPU", "mtia": "MTIA device"}


@dataclass(frozen=True)
class Choice:
    """The device type and backend for the processes of one job, and why."""

    device_type: str  # "cpu" or an accelerator type ("cuda", "xpu", "mps", ...)
    backend: str  # the process-group backend ranks use ("gloo", "nccl", "xccl", ...)
    reason: str  # one sentence, for the launcher's first line and the notebooks


def accelerator() -> tuple[str | None, int]:
    """(type, count) of the accelerator this process sees, e.g. ``("cuda", 2)``; ``(None, 0)`` without one.

    Without any accelerator device file on Linux the answer is known without importing torch (~2 s).
    """
    if _no_accelerator_possible():
        return None, 0
    import torch

    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is None:
        return None, 0
    return acc.type, torch.accelerator.device_count()


def _no_accelerator_possible() -> bool:
    """True when this is Linux and no GPU/accelerator device node exists, so torch could not find one."""
    if not sys.platform.startswith("linux"):
        return False  # macOS (MPS), Windows: ask torch
    dev = Path("/dev")
    nodes = ("nvidia*", "kfd", "dri/renderD*", "accel*", "hl*", "davinci*", "neuron*", "mtia*")
    return not any(next(dev.glob(pattern), None) for pattern in nodes)


def accelerator_name(device_type: str | None) -> str:
    """What to call one device of this type in a sentence: "GPU", "XPU", "MPS device"."""
    return NAMES.get(device_type or "", f"{device_type} device")


def backend_of(device_type: str) -> str | None:
    """PyTorch's default process-group backend for this device type (None if it knows none)."""
    if device_type == "cpu":
        return CPU_BACKEND
    from torch.distributed import Backend

    return Backend.default_device_backend_map.get(device_type)


def carries(backend: str, device_type: str) -> bool:
    """Whether ``backend`` can run collectives on tensors of ``device_type`` (PyTorch's capability table)."""
    from torch.distributed import Backend

    return device_type in Backend.backend_capability.get(backend, ())


def built(backend: str) -> bool:
    """Whether this build of PyTorch has ``backend`` (nccl: Linux CUDA wheels have it, Windows wheels do not)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_backend_available(backend)


def choose(nproc: int = 1, backend: str = "auto", *, ranks: bool = True, report=None) -> Choice:
    """The one rule: the device type and backend for ``nproc`` processes on this machine.

    ranks: the processes form a process group (torchrun, DDP); False: one plain process, which may
      use any accelerator (MPS too), since no backend has to carry its tensors.
    backend: "auto"; "gloo" (the CPU, even on a GPU machine); or the accelerator's own backend
      ("nccl", "xccl"), which is refused (ValueError) without one device per process.
    report: (type, count) instead of asking the hardware (tests).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    acc, count = report if report is not None else accelerator()
    native = backend_of(acc) if acc else None
    name = accelerator_name(acc)
    if backend not in ("auto", CPU_BACKEND):
        wanted = _device_of_backend(backend)
        if wanted is None:
            raise ValueError(f"backend must be 'auto', '{CPU_BACKEND}' or an accelerator's backend, got {backend!r}")
        if acc != wanted or count < nproc:
            found = f"{count} {name}(s) found" if acc == wanted else f"no {accelerator_name(wanted)} found" + (
                f" (this machine has {count} {acc})" if acc else "")
            raise ValueError(f"{backend} needs one {accelerator_name(wanted)} per process: {nproc} processes "
                             f"requested, {found}. Use backend='{CPU_BACKEND}' (CPU) or fewer processes.")
        if not built(backend):
            raise ValueError(f"{backend} is not in this build of PyTorch (Windows builds have no nccl). "
                             f"Use backend='{CPU_BACKEND}' (CPU).")
    if backend == CPU_BACKEND:
        return Choice("cpu", CPU_BACKEND, f"{CPU_BACKEND} requested: {CPU_BACKEND} on the CPU")
    cpu = f"{CPU_BACKEND} on the CPU"
    if not acc or count == 0:
        return Choice("cpu", CPU_BACKEND, f"no accelerator found: {cpu}")
    if not ranks and nproc == 1:
        return Choice(acc, native or CPU_BACKEND, f"1 process, no process group: it uses the {name}")
    if native is None or not carries(native, acc):
        why = (f"PyTorch's backend for {acc} is {native}, which cannot carry {acc} tensors" if native
               else f"PyTorch knows no process-group backend for {acc}")
        return Choice("cpu", CPU_BACKEND, f"{why}: ranks use {cpu}")
    if not built(native):
        return Choice("cpu", CPU_BACKEND, f"PyTorch's backend for {acc} is {native}, which this build of PyTorch "
                                          f"does not have: ranks use {cpu}")
    if nproc > count:
        return Choice("cpu", CPU_BACKEND, f"{nproc} processes > {count} {name}(s): {cpu}")
    return Choice(acc, native, f"{count} {name}(s) found: one process per {name}, {native}")


def _device_of_backend(backend: str) -> str | None:
    from torch.distributed import Backend

    return next((d for d, b in Backend.default_device_backend_map.items() if b == backend and d != "cpu"), None)


def cpu_cores() -> int:
    """CPU cores this process may use (respects container/affinity limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
