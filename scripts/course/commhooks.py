"""Count what DDP sends: a communication hook that records each all-reduce and its bytes, then all-reduces
the bucket exactly as DDP's default does (notebook 05).

    counter = CommCounter()
    counter.register(ddp_model)                  # or compress="fp16" / "bf16"
    ... one training step ...
    all_reduces, sent = counter.take()          # since the last take(): 1 all-reduce per bucket

DDP calls a communication hook once per gradient bucket, when the bucket is ready in backward;
``model.no_sync()`` skips it. ``compress`` casts the bucket first, the way torch's
``fp16_compress_hook`` / ``bf16_compress_hook`` do (each is ``*_compress_wrapper(allreduce_hook)``,
as their docstrings say), so the count is of the bytes really all-reduced.
"""

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class CommCounter:
    def __init__(self):
        self.all_reduces = 0
        self.bytes = 0

    def hook(self, process_group, bucket: dist.GradBucket):
        buffer = bucket.buffer()
        self.all_reduces += 1
        self.bytes += buffer.numel() * buffer.element_size()
        return default_hooks.allreduce_hook(process_group, bucket)  # divides by the world size, all-reduces

    def register(self, model, compress: str | None = None) -> None:
        """Install on a DDP model. compress: None (fp32 as the gradients are), "fp16" or "bf16".

        torch refuses the bf16 wrapper (by name, TypeError) on builds without CUDA and NCCL >= 2.10."""
        wrappers = {None: lambda hook: hook, "fp16": default_hooks.fp16_compress_wrapper,
                    "bf16": default_hooks.bf16_compress_wrapper}
        model.register_comm_hook(None, wrappers[compress](self.hook))

    def take(self) -> tuple[int, int]:
        """(all-reduces, bytes) since the last call, and start counting afresh."""
        counts = self.all_reduces, self.bytes
        self.all_reduces = self.bytes = 0
        return counts
