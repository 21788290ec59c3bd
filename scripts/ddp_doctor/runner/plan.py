"""What a launch will use, decided before anything starts: device, backend, CPU threads per rank and
refusals (from ddp_doctor.hardware's one rule), and the torchrun command line."""

import sys
from dataclasses import dataclass
from pathlib import Path

from ddp_doctor.hardware import accelerator_name, choose, cpu_cores


class LaunchRefused(ValueError):
    """A launch that ``plan()`` refuses before anything starts (e.g. more CPU ranks than cores)."""


@dataclass
class Plan:
    """What a launch will use, decided from the hardware before anything starts (ddp_doctor.hardware's rule)."""

    nproc: int
    backend: str  # the process-group backend of the ranks: "gloo", "nccl", "xccl", ...
    device: str  # the device type: "cpu", "cuda", "xpu", "mps" (mps: a single plain process only)
    threads_per_rank: int
    reason: str
    refusal: str | None = None  # why launch() refuses this plan (None: it runs)
    accelerator: str | None = None  # what the machine has, e.g. "cuda" (None: nothing)
    accelerators: int = 0

    def env(self) -> dict[str, str]:
        """The environment the ranks get from this plan: CPU threads, and no GPU for CPU ranks on a GPU box."""
        env = {"OMP_NUM_THREADS": str(self.threads_per_rank)}
        if self.device == "cpu" and self.accelerator == "cuda" and self.accelerators > 0:
            env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on a GPU box: keep every rank on the CPU
        return env

    def line(self, threads: str | None = None) -> str:
        """The plan in one line; ``threads``: the OMP_NUM_THREADS the caller set instead of the plan's."""
        given = f"{threads} CPU thread(s) per rank (OMP_NUM_THREADS given)"
        group = (f"{self.nproc} process(es), {self.backend} on {self.device} ({self.reason}); " if self.nproc > 1 else
                 f"1 process on {self.device}; ")  # one process: a backend only if the script makes a group
        return (group
                + (given if threads and threads != str(self.threads_per_rank)
                   else f"{self.threads_per_rank} CPU thread(s) per rank"))


def plan(nproc: int, backend: str = "auto", *, allow_oversubscribe: bool = False, report=None) -> Plan:
    """Choose backend, device and CPU threads per rank with ddp_doctor.hardware's rule; decide refusals.

    Raises ValueError for what cannot work (nccl without a GPU per process). What works but only
    makes things worse (more CPU ranks than cores) is recorded in ``refusal``: launch() and the
    widget refuse it, unless ``allow_oversubscribe=True`` (to demonstrate oversubscription).
    report: a faked (accelerator type, count), for tests.
    """
    from ddp_doctor.hardware import accelerator

    acc, count = report if report is not None else accelerator()
    chosen = choose(nproc, backend, ranks=True, report=(acc, count))
    device, reason = chosen.device_type, chosen.reason
    if nproc == 1:
        plain = choose(1, backend, ranks=False, report=(acc, count))
        if plain.device_type != device:  # MPS: a plain script uses it, a process group cannot
            device = plain.device_type
            reason = (f"1 process: a plain script uses the {accelerator_name(acc)}; a script that starts a "
                      f"process group uses {chosen.backend} on {chosen.device_type} ({chosen.reason})")
    if device == "cpu":
        reason += "; these are CPU numbers"
    # Threads: split the cores between ranks; more threads than cores makes every rank slower.
    cores = cpu_cores()
    threads = max(1, cores // nproc)
    refusal = None
    if device == "cpu" and nproc > cores and not allow_oversubscribe:
        refusal = (f"{nproc} processes on the CPU, but this machine has {cores} CPU cores. Each rank needs a "
                   f"core of its own: more ranks than cores fight over them and the run gets slower, not "
                   f"faster. Use at most {cores} processes.")
    return Plan(nproc, chosen.backend, device, threads, reason, refusal, acc, count)


RENDEZVOUS_FLAGS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
                    "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--master-addr", "--master_addr", "--master-port",
                    "--master_port")


def max_restarts(torchrun_args) -> int:
    """The ``--max-restarts`` (or ``--max_restarts``) asked for in torchrun's arguments; 0 if none."""
    args = [str(a) for a in torchrun_args]
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--max-restarts", "--max_restarts"):
            value = value or (args[i + 1] if i + 1 < len(args) else "0")
            return int(value) if value.lstrip("-").isdigit() else 0
    return 0


def torchrun_command(script: str | Path, nproc: int, args=(), torchrun_args=(), standalone: bool = True) -> list[str]:
    """The torchrun command line, output tagged by rank (``--tee=3 --role=rank``: lines start ``[rankN]:``).

    standalone=True: one node, its rendezvous on a free port (``--standalone``); rendezvous flags in
    ``torchrun_args`` are refused, since --standalone would silently override them.
    standalone=False: the caller gives the rendezvous in ``torchrun_args``, e.g. two simulated nodes:
    ``["--nnodes=2", "--node-rank=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]``
    (or ``--master-addr``/``--master-port``).
    """
    torchrun_args = [str(a) for a in torchrun_args]
    if standalone:
        clash = [a for a in torchrun_args if a.split("=", 1)[0] in RENDEZVOUS_FLAGS]
        if clash:
            raise ValueError(f"{' '.join(clash)}: rendezvous flags need standalone=False "
                             "(--standalone picks its own rendezvous and would ignore them)")
    return [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else []),
            f"--nproc-per-node={nproc}", "--tee=3", "--role=rank", *torchrun_args, str(Path(script).resolve()),
            *map(str, args)]
