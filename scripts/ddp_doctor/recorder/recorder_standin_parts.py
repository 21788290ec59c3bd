"""CUDA objects of the CPU stand-in (``recorder_standin.py``) made of CPU parts: a pretended GPU's properties,
streams and events that keep the wall clock, and SyncBatchNorm whose statistics are all-reduced over the group."""

import os


def properties(*args):
    """torch.cuda.get_device_properties of a pretended GPU."""
    from types import SimpleNamespace

    return SimpleNamespace(name="CPU (the doctor's stand-in)", major=8, minor=0, total_memory=memory(),
                           multi_processor_count=os.cpu_count() or 1, is_integrated=False)


def memory() -> int:
    """This machine's memory in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def streams(torch, note) -> None:
    """CUDA streams, events and device contexts on the CPU: work runs in order, so a stream has nothing to wait for;
    an event records the wall clock, so the script's own GPU timings time the CPU. DataLoader's pin_memory is off."""
    import contextlib
    import time

    class Stream:
        def __init__(self, *args, **kwargs):
            note()

        def synchronize(self): pass
        def wait_stream(self, other): pass
        def wait_event(self, event): pass
        def query(self): return True
        def record_event(self, event=None):
            event = event or Event()
            event.record()
            return event

    class Event:
        def __init__(self, *args, **kwargs):
            self.at = None

        def record(self, stream=None):
            note()
            self.at = time.perf_counter()

        def elapsed_time(self, end) -> float:  # milliseconds, as CUDA's
            return (end.at - self.at) * 1000.0

        def synchronize(self): pass
        def wait(self, stream=None): pass
        def query(self): return True

    class Device(contextlib.nullcontext):  # torch.cuda.device(i): a context with nothing to switch
        def __init__(self, device=None):
            note()
            super().__init__()

    default = Stream.__new__(Stream)
    for name, value in (("Stream", Stream), ("Event", Event), ("device", Device),
                        ("current_stream", lambda *a, **k: default), ("default_stream", lambda *a, **k: default),
                        ("stream", lambda *a, **k: contextlib.nullcontext())):
        setattr(torch.cuda, name, value)
    loader = torch.utils.data.DataLoader.__init__

    def unpinned(self, *args, **kwargs):
        if kwargs.get("pin_memory"):
            note()
            kwargs["pin_memory"] = False
        return loader(self, *args, **kwargs)

    unpinned.__wrapped__ = loader
    torch.utils.data.DataLoader.__init__ = unpinned


def sync_batch_norm(torch, note) -> None:
    """SyncBatchNorm on CPU tensors, as on GPUs: the batch statistics all-reduced over the group (autograd through
    the all-reduce), so that every rank normalises over the samples of all ranks. torch 2.14's SyncBatchNorm
    refuses CPU input in training ("expected input tensor to be on GPU")."""
    import torch.distributed as dist

    def all_reduce(tensor, group):  # unrecorded: torch's own work on GPUs (NCCL inside the layer), not the script's
        reduce = dist.all_reduce
        while hasattr(reduce, "__wrapped__"):
            reduce = reduce.__wrapped__
        reduce(tensor, group=group)

    class SumOverRanks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor, group):
            ctx.group = group
            tensor = tensor.clone()
            all_reduce(tensor, group)
            return tensor

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            all_reduce(grad, ctx.group)
            return grad, None

    cls = torch.nn.SyncBatchNorm
    original = cls.forward

    def forward(self, input):
        if input.device.type != "cpu" or not (self.training and dist.is_available() and dist.is_initialized()):
            return original(self, input)
        group = self.process_group or dist.group.WORLD
        if dist.get_world_size(group) == 1:  # nothing to sync; torch would still refuse CPU input
            return torch.nn.modules.batchnorm._BatchNorm.forward(self, input)
        note()
        c, dims = input.size(1), [0, *range(2, input.dim())]
        count = torch.tensor([input.numel() // c], dtype=input.dtype)
        total_stats = SumOverRanks.apply(torch.cat([input.sum(dims), (input * input).sum(dims), count]), group)
        total = total_stats[-1]
        mean, var = total_stats[:c] / total, total_stats[c:2 * c] / total - (total_stats[:c] / total) ** 2
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                self.running_var.mul_(1 - momentum).add_(var.detach() * (total / (total - 1)) * momentum)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        return out * self.weight.reshape(shape) + self.bias.reshape(shape) if self.affine else out

    forward.__wrapped__ = original
    cls.forward = forward
    ddp = torch.nn.parallel.DistributedDataParallel
    refuse = ddp._passing_sync_batchnorm_handle  # DDP refuses SyncBatchNorm in a CPU module: allowed, as above

    def allow(self, module):
        if self.device_type == "cpu" and any(isinstance(m, cls) for m in module.modules()):
            note()
            return None
        return refuse(self, module)

    allow.__wrapped__ = refuse
    ddp._passing_sync_batchnorm_handle = allow
