"""Record what a rank's pipeline stages do (notebook 11): every forward, backward and weight-gradient chunk and
every send/recv wait, timed, and the activation bytes autograd keeps for backward.

    rec = StageRecorder(stages, device)   # the PipelineStages of this rank (torch.distributed.pipelining)
    with rec.step():                      # one schedule.step(...), after a barrier
        schedule.step(...)
    rec.events        # [(kind, start_s, end_s, stage, micro-batch)], kind: F, B, W or wait (stage, mb: -1)
    rec.windows       # [(start_s, end_s)] of each recorded step
    rec.peak_activation_bytes, rec.peak_in_flight   # of the last step

The recorder wraps the stages' ``forward_one_chunk``/``backward_one_chunk``/``backward_weight_one_chunk``
and the schedules' module-level ``_wait_batch_p2p`` (the names in torch 2.14; the schedules call them by
these names). On an accelerator it synchronises around each, so that a time is the device's. Times are
``time.perf_counter()``: one clock for all processes of one machine, so ranks' timelines line up.
Activation bytes: every tensor autograd saves while a forward chunk runs, less the parameters, counted
once per storage and until backward frees it (``saved_tensors_hooks``). course.bubble reads the events.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

_ACTIVE: list = []  # the recorder whose step() is running (the schedules' wait function is shared)


class _Saved:
    """One saved tensor's bytes, counted while autograd keeps it (until backward frees the graph)."""

    def __init__(self, recorder, tensor):
        self.recorder, self.tensor = recorder, tensor
        self.key = tensor.untyped_storage().data_ptr()
        self.recorder._hold(self.key, tensor.untyped_storage().nbytes())

    def __del__(self):
        self.recorder._release(self.key)


class StageRecorder:
    """Times what this rank's pipeline stages do, and counts the activations they keep for backward."""

    def __init__(self, stages, device=None):
        self.events: list[tuple[str, float, float, int, int]] = []
        self.windows: list[tuple[float, float]] = []
        self.peak_activation_bytes = 0
        self.peak_in_flight = 0
        self._live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self._bytes = 0
        self._in_flight = 0
        self._sync = (lambda: torch.accelerator.synchronize()) if device is not None and \
            torch.device(device).type != "cpu" else (lambda: None)
        self._params = {p.untyped_storage().data_ptr() for s in stages for p in s.submod.parameters()}
        for stage in stages:
            self._wrap(stage, "forward_one_chunk", "F")
            self._wrap(stage, "backward_one_chunk", "B")
            self._wrap(stage, "backward_weight_one_chunk", "W")
        self._patch_waits()

    def _hold(self, key, nbytes):
        entry = self._live.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self._bytes += nbytes
            self.peak_activation_bytes = max(self.peak_activation_bytes, self._bytes)
        entry[0] += 1

    def _release(self, key):
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._bytes -= entry[1]
            del self._live[key]

    def _pack(self, tensor):
        if tensor.untyped_storage().data_ptr() in self._params or tensor.numel() == 0:
            return tensor  # a weight, not an activation
        return _Saved(self, tensor)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _wrap(self, stage, method, kind):
        inner = getattr(stage, method)

        def timed(chunk_id, *args, **kwargs):
            self._sync()
            start = time.perf_counter()
            if kind == "F":
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    out = inner(chunk_id, *args, **kwargs)
                self._in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            else:
                out = inner(chunk_id, *args, **kwargs)
                if kind == "B":
                    self._in_flight -= 1
            self._sync()
            self.events.append((kind, start, time.perf_counter(), stage.stage_index, int(chunk_id)))
            return out

        setattr(stage, method, timed)

    def _patch_waits(self):
        """Wrap the schedules' one wait function once; it records into the recorder whose step is running."""
        from torch.distributed.pipelining import schedules

        if getattr(schedules._wait_batch_p2p, "course_timed", False):
            return
        original = schedules._wait_batch_p2p

        def timed_wait(work):
            start = time.perf_counter()
            original(work)
            if _ACTIVE:
                _ACTIVE[-1]._sync()
                _ACTIVE[-1].events.append(("wait", start, time.perf_counter(), -1, -1))

        timed_wait.course_timed = True
        schedules._wait_batch_p2p = timed_wait

    @contextmanager
    def step(self):
        """Record one schedule step: its window, and (reset for each step) the peaks of activations held."""
        self.peak_activation_bytes, self.peak_in_flight, self._in_flight = self._bytes, 0, 0
        self._sync()
        start = time.perf_counter()
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.remove(self)
        self._sync()
        self.windows.append((start, time.perf_counter()))
