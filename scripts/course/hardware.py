"""Which device and process-group backend a process should use, decided from the hardware.

The rule, used by the launcher and by every script: if the machine has an accelerator
for every local process, each process gets its own (``cuda:LOCAL_RANK``) and the backend is the
one PyTorch recommends for it (nccl for CUDA). Otherwise every process runs on the CPU with gloo.
Nothing here hard-codes ``cuda`` or ``nccl``.
"""

import os

import torch
import torch.distributed as dist


def accelerator_count() -> int:
    """Number of accelerator devices (GPUs) visible to this process; 0 on a CPU-only machine."""
    if not torch.accelerator.is_available():
        return 0
    return torch.accelerator.device_count()


def pick_device(local_rank: int = 0) -> torch.device:
    """The device for the process with this LOCAL_RANK (0 for a single-process script).

    CPU unless there is one accelerator per local process: two processes sharing one GPU
    is a pitfall, not a configuration.
    """
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if accelerator_count() >= local_world_size:
        return torch.device(torch.accelerator.current_accelerator().type, local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The process-group backend PyTorch recommends for this device: nccl for CUDA, gloo for CPU."""
    return dist.get_default_backend_for_device(device)


def cpu_cores() -> int:
    """CPU cores this process may use (respects container/affinity limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def describe() -> dict:
    """A summary of the hardware, for notebook 00 and the launcher's first line."""
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return {
        "torch": torch.__version__,
        "cpu_cores": cpu_cores(),
        "accelerator": accel.type if accel else None,
        "accelerator_count": accelerator_count(),
        "device_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
    }
