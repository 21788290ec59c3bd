"""The CPU stand-in (used by ``recorder.py`` with ``COURSE_RECORD_STANDIN=1``, imported by its plain name): a
script written for CUDA and NCCL runs on a CPU machine, its source untouched.

Built on PyTorch's own interposition points, installed in each process before the script runs:
- a ``TorchFunctionMode`` turns every CUDA device argument into the CPU: ``device=`` of any torch function,
  ``Tensor.to(int | "cuda..." | torch.device("cuda", i))``, ``Tensor.cuda()``, ``pin_memory()`` (``Module.to``
  and ``Module.cuda`` reach these);
- wrappers: ``init_process_group``/``new_group`` take gloo for nccl (and drop a CUDA ``device_id``), DDP drops
  ``device_ids``/``output_device``, ``barrier`` drops ``device_ids``, ``torch.load`` maps CUDA storage to the
  CPU; ``torch.cuda.set_device``, ``synchronize``, ``empty_cache`` do nothing and the memory statistics are 0;
  ``torch.autocast("cuda")`` and ``GradScaler("cuda")`` are disabled, as they are on a CPU (without the warning).
- With ``pretend`` (the script has no CPU path, or its CPU path stopped before a process group),
  ``torch.cuda.is_available()``, ``torch.accelerator.is_available()`` are True, ``device_count()`` the GPUs a
  node would have and ``current_accelerator()`` CUDA, for the script's own calls only (torch's internals still see
  the CPU);
- ``SyncBatchNorm`` on the CPU all-reduces its batch statistics over the group as it does on GPUs.
Each redirected call's place in the script (``file:line``) is added to ``record["standin"]``. ``INVENTORY`` lists
what a CUDA-written script may ask and what it is told here (tests/test_doctor_runner.py walks it).
"""

import inspect
import os
import sys
import warnings

# What a script written for CUDA may ask, and its answer here ("pretend": only when pretending GPUs, else the truth):
# {id: (the calls, the answer)}.
INVENTORY = {
    "available": ("torch.cuda.is_available / is_bf16_supported, torch.backends.cudnn.is_available", "True (pretend)"),
    "count": ("torch.cuda.device_count, torch.accelerator.device_count", "the GPUs of a node (pretend)"),
    "current": ("torch.cuda.current_device, torch.accelerator.current_device_index", "LOCAL_RANK (pretend)"),
    "accelerator": ("torch.accelerator.is_available / current_accelerator", "True, cuda (pretend)"),
    "properties": ("torch.cuda.get_device_name / get_device_properties / get_device_capability",
                   "the stand-in, 8.0 (pretend)"),
    "memory_info": ("torch.cuda.mem_get_info / utilization", "this machine's memory, 0 % (pretend)"),
    "no_op": (("torch.cuda.set_device / synchronize / empty_cache / ipc_collect / device(i), "
              "torch.accelerator.set_device_index / synchronize"), "nothing to do"),
    "memory_stats": ("torch.cuda.memory_allocated, max_..., reserved, reset_..., memory_summary", "0"),
    "streams": ("torch.cuda.Stream / current_stream / default_stream / stream(s) / Event",
                "in order on the CPU; events time the wall clock"),
    "devices": ("device='cuda' / 'cuda:i' / i / torch.device('cuda'), .to(...), .cuda(), Module.to / .cuda", "the CPU"),
    "pinned": ("pin_memory(), DataLoader(pin_memory=True), non_blocking=True", "unpinned CPU tensors"),
    "cudnn": ("torch.backends.cudnn.benchmark / deterministic / allow_tf32", "set, unused on a CPU"),
    "amp": ("torch.autocast('cuda'), GradScaler('cuda'), torch.cuda.amp's", "disabled, as on a CPU"),
    "groups": ("init_process_group / new_group('nccl', device_id=...), barrier(device_ids=...)", "gloo, no device"),
    "ddp": ("DDP(device_ids=..., output_device=...)", "a CPU module"),
    "sync_bn": ("SyncBatchNorm", "statistics all-reduced over the group on the CPU"),
    "load": ("torch.load(map_location='cuda...')", "the CPU"),
    "nccl_env": ("NCCL_* environment variables", "unread: gloo carries the collectives"),
}


def _cuda(device) -> bool:
    """Whether a device argument names a CUDA device (an int is a CUDA index where a device is expected)."""
    import torch

    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def install(record: dict, where, pretend: bool, gpus: int) -> None:
    import recorder_standin_parts as parts  # this file's folder is on sys.path: a sibling by its plain name
    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    torch_dir = os.path.dirname(torch.__file__) + os.sep

    def note() -> None:
        site, sites = where(), record.setdefault("standin", [])
        if site and site not in sites:
            sites.append(site)

    def learners(depth: int = 2) -> bool:  # the caller is not torch itself
        return not sys._getframe(depth).f_code.co_filename.startswith(torch_dir)

    to, cuda, pin = torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.pin_memory

    class CPU(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            while hasattr(func, "__recorder__"):  # a Tensor method the recorder wraps: it has recorded the call
                func = func.__recorder__
            if func is to and len(args) > 1 and _cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
                note()
            elif func is cuda or func is pin:
                note()
                return args[0]
            if "device" in kwargs and _cuda(kwargs["device"]):
                kwargs = {**kwargs, "device": "cpu"}
                note()
            return func(*args, **kwargs)

    CPU().__enter__()  # for the whole process: never left

    def replace(owner, name, make):
        original = getattr(owner, name)
        wrapper = make(original)
        wrapper.__wrapped__ = original
        setattr(owner, name, wrapper)

    def answer(value, real):
        def fn(*args, **kwargs):
            if pretend and learners():
                note()
                return value() if callable(value) else value
            return real(*args, **kwargs)
        return fn

    local = int(os.environ.get("LOCAL_RANK") or 0)
    replace(torch.cuda, "is_available", lambda real: answer(True, real))
    replace(torch.cuda, "device_count", lambda real: answer(gpus, real))
    replace(torch.cuda, "is_bf16_supported", lambda real: answer(True, real))
    replace(torch.cuda, "current_device", lambda real: answer(lambda: local, real))
    replace(torch.cuda, "get_device_name", lambda real: answer("CPU (the doctor's stand-in)", real))

    def nothing(value=None):
        def make(real):
            def fn(*args, **kwargs):
                note()
                return value
            return fn
        return make

    for name in ("set_device", "synchronize", "empty_cache", "ipc_collect", "reset_peak_memory_stats",
                 "reset_max_memory_allocated"):
        replace(torch.cuda, name, nothing())
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        replace(torch.cuda, name, nothing(0))
    # torch.accelerator, the device-neutral API (pytorch/examples counts its devices with it): the same answers
    accel = torch.accelerator
    replace(accel, "is_available", lambda real: answer(True, real))
    replace(accel, "device_count", lambda real: answer(gpus, real))
    replace(accel, "current_accelerator", lambda real: answer(lambda: torch.device("cuda"), real))
    replace(accel, "current_device_index", lambda real: answer(lambda: local, real))
    for name in ("set_device_index", "synchronize"):  # nothing to do on the pretended GPUs
        replace(accel, name, lambda real: answer(None, real))
    replace(torch.backends.cudnn, "is_available", lambda real: answer(True, real))
    replace(torch.cuda, "get_device_properties", lambda real: answer(parts.properties, real))
    replace(torch.cuda, "get_device_capability", lambda real: answer((8, 0), real))
    replace(torch.cuda, "mem_get_info", lambda real: answer(lambda: (parts.memory(),) * 2, real))
    replace(torch.cuda, "utilization", lambda real: answer(0, real))
    replace(torch.cuda, "memory_summary", nothing("(no CUDA memory: the doctor's CPU stand-in)"))
    parts.streams(torch, note)
    parts.sync_batch_norm(torch, note)

    def backend(value):
        if value is not None and "nccl" in str(value).lower():
            note()
            return "gloo"
        return value

    def init_gloo(real):
        params = inspect.signature(real)

        def fn(*args, **kwargs):
            given = params.bind_partial(*args, **kwargs).arguments
            given["backend"] = backend(given.get("backend"))
            if _cuda(given.get("device_id")):
                given.pop("device_id")
                note()
            return real(**given)
        return fn

    replace(dist, "init_process_group", init_gloo)
    replace(dist, "new_group", init_gloo)

    def barrier(real):
        def fn(*args, **kwargs):
            if kwargs.get("device_ids") is not None:
                kwargs.pop("device_ids")
                note()
            return real(*args, **kwargs)
        return fn

    replace(dist, "barrier", barrier)

    ddp = torch.nn.parallel.DistributedDataParallel
    ddp_params = inspect.signature(ddp.__init__)

    def ddp_init(real):
        def fn(*args, **kwargs):
            given = ddp_params.bind_partial(*args, **kwargs).arguments
            for name in ("device_ids", "output_device"):
                if given.get(name) is not None:
                    given.pop(name)
                    note()
            extra = given.pop("kwargs", {})
            return real(**given, **extra)
        return fn

    replace(ddp, "__init__", ddp_init)

    def load(real):
        def fn(*args, **kwargs):
            where_to = kwargs.get("map_location")
            if where_to is None or _cuda(where_to) or (isinstance(where_to, dict)
                                                       and any(_cuda(v) for v in where_to.values())):
                if where_to is not None:
                    note()
                kwargs["map_location"] = "cpu"
            return real(*args, **kwargs)
        return fn

    replace(torch, "load", load)

    def quiet_cuda(real):  # autocast("cuda") and GradScaler("cuda") disable themselves on a CPU: without a warning
        def fn(self, *args, **kwargs):
            device = args[0] if args else kwargs.get("device_type", kwargs.get("device", "cuda"))
            if device == "cuda" and kwargs.get("enabled", True):
                note()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return real(self, *args, **kwargs)
            return real(self, *args, **kwargs)
        return fn

    replace(torch.amp.autocast_mode.autocast, "__init__", quiet_cuda)
    replace(torch.amp.GradScaler, "__init__", quiet_cuda)
    for cls in (torch.cuda.amp.autocast, torch.cuda.amp.GradScaler):  # the deprecated spellings: "cuda" implied
        replace(cls, "__init__", lambda real: lambda self, *a, **k: _quietly(note, real, self, *a, **k))


def _quietly(note, real, *args, **kwargs):
    if kwargs.get("enabled", True):
        note()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return real(*args, **kwargs)
