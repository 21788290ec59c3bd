"""Which device and process-group backend a process uses: the rule of ``ddp_doctor.hardware`` (the take-home
doctor plans its jobs by it too), and a process's own device by it.

    from course.hardware import backend_for, pick_device
    device = pick_device(local_rank)               # a rank of a process group (under torchrun)
    dist.init_process_group(backend_for(device))
    device = pick_device()                         # a plain single-process script

Nothing here hard-codes ``cuda`` or ``nccl``. The rule's functions are called through their module (``rule``), so
that a test that fakes the machine there fakes it for these too.
"""

import os

from ddp_doctor import hardware as rule
from ddp_doctor.hardware import (  # noqa: F401 (the rule, importable from here as the course's scripts do)
    CPU_BACKEND,
    NAMES,
    Choice,
    accelerator,
    accelerator_name,
    backend_of,
    built,
    carries,
    choose,
    cpu_cores,
)


def accelerator_count() -> int:
    """Number of accelerator devices (GPUs, XPUs, ...) visible to this process; 0 on a CPU-only machine."""
    return rule.accelerator()[1]


def pick_device(local_rank: int | None = None):
    """The device for this process.

    pick_device(local_rank): a rank of a process group (under torchrun, LOCAL_WORLD_SIZE processes on
      this machine): ``<accelerator>:local_rank`` if the rule gives the ranks an accelerator, else the CPU.
    pick_device(): a plain single-process script: its accelerator if there is one (MPS too), else the CPU.
    """
    import torch

    if local_rank is None:
        chosen = rule.choose(1, ranks=False)
        return torch.device(chosen.device_type, 0) if chosen.device_type != "cpu" else torch.device("cpu")
    chosen = rule.choose(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), ranks=True)
    return torch.device(chosen.device_type, local_rank) if chosen.device_type != "cpu" else torch.device("cpu")


def backend_for(device) -> str:
    """The process-group backend for ranks on ``device``: PyTorch's default for it (nccl for CUDA, xccl
    for XPU, gloo for the CPU). Refuses a device that backend cannot carry (MPS: use the CPU for ranks)."""
    import torch
    import torch.distributed as dist

    device_type = torch.device(device).type
    backend = dist.get_default_backend_for_device(device_type)
    if not rule.carries(backend, device_type):
        raise ValueError(f"{backend} (PyTorch's default backend for {device_type}) cannot carry {device_type} "
                         f"tensors between processes: put the ranks on the CPU (pick_device(local_rank) does)")
    if not rule.built(backend):
        raise ValueError(f"{backend} (PyTorch's default backend for {device_type}) is not in this build of PyTorch "
                         f"(Windows builds have no nccl): put the ranks on the CPU (pick_device(local_rank) does)")
    return backend


def describe(nproc: int = 2) -> dict:
    """A summary of the hardware, for notebook 00: what is built, what is usable, what ``nproc`` ranks get."""
    import torch
    import torch.distributed as dist

    acc, count = rule.accelerator()
    try:
        names = [getattr(torch, acc).get_device_name(i) for i in range(count)] if acc else []
    except (AttributeError, RuntimeError, AssertionError):  # a backend module without names (or a faked report)
        names = []
    ranks = rule.choose(nproc)
    return {
        "torch": torch.__version__,
        "cpu_cores": rule.cpu_cores(),
        "accelerator": acc,
        "accelerator_count": count,
        "device_names": names,
        "gloo": dist.is_gloo_available(),
        "nccl_built": dist.is_nccl_available(),  # compiled in (Linux CUDA wheels; Windows has none), even without a GPU
        "nccl_usable": dist.is_nccl_available() and acc == "cuda" and count >= 1,
        f"{nproc} ranks use": f"{ranks.backend} on {ranks.device_type} ({ranks.reason})",
    }
