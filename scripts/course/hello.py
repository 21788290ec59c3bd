"""Notebook 00's plumbing: the all_reduce timing that ``hello_distributed.py`` runs, the lines and the figure
the notebook shows from its metrics.json, and torchrun's own rank assignment for the Check yourself.

Timing on a shared machine: one burst of other work lasts milliseconds, longer than a small all_reduce, so a
size timed once can come out slower than a size 16 times larger. Here every size is timed in ``rounds``
interleaved passes (after one untimed pass), each the median of 9 calls, and reported as the median over the
passes with their range; the local copy that the largest size is compared with is timed in the same passes, so
that size has one bus bandwidth, not one per measurement.
"""

import statistics

import torch
import torch.distributed as dist

from course.measure import Comparison, Measurement, _fmt, time_call  # _fmt: as the table prints

FIRST_KIB = 16


def _seconds_per_call(fn, device) -> float:
    def call():
        fn()
        if device.type != "cpu":
            torch.accelerator.synchronize()  # GPU work is queued: wait for it before reading the clock
    return statistics.median(time_call(call, repeats=9, warmup=1))


def time_all_reduce(device, max_mib: int, rounds: int, log, show: bool) -> dict:
    """all_reduce time and bus bandwidth for 16 KiB ... ``max_mib`` MiB, and a local copy of the largest message
    timed in the same rounds (before the sizes in one round, after them in the next): the largest size's rounds
    are both its line and the comparison's all_reduce row, so each size has one figure.
    Every rank must call it (all_reduce is a collective); ``show``: print (rank 0)."""
    world_size = dist.get_world_size()
    ring = 2 * (world_size - 1) / world_size  # share of the message each rank sends in a ring all_reduce
    sizes = [FIRST_KIB * 4 ** i for i in range(20) if FIRST_KIB * 4 ** i <= max_mib * 1024]
    tensors = {kib: torch.zeros(kib * 1024 // 4, device=device) for kib in sizes}  # fp32: 4 bytes per element
    source = tensors[sizes[-1]]
    target = torch.empty_like(source)
    times: dict[int, list[float]] = {kib: [] for kib in sizes}
    copies: list[float] = []
    for index in range(rounds + 1):  # the first pass is untimed: connections and buffers are set up in it
        copy_first = index % 2 == 1  # alternate, as course.measure.compare does: neither always runs warm
        if copy_first:
            copy_seconds = _seconds_per_call(lambda: target.copy_(source), device)
        for kib in sizes:
            seconds = _seconds_per_call(lambda t=tensors[kib]: dist.all_reduce(t), device)
            if index:
                times[kib].append(seconds)
        if not copy_first:
            copy_seconds = _seconds_per_call(lambda: target.copy_(source), device)
        if index:
            copies.append(copy_seconds)
    bandwidth = {}
    for kib in sizes:
        seconds = statistics.median(times[kib])
        bus_gbps = statistics.median(ring * kib * 1024 / s / 1e9 for s in times[kib])  # comparable across world sizes
        log.scalar("all_reduce/bus_bandwidth_GBps", bus_gbps, kib)  # TensorBoard's step axis = size in KiB
        log.scalar("all_reduce/time_ms", seconds * 1e3, kib)
        bandwidth[kib] = round(bus_gbps, 3)
        if show:
            print(f"all_reduce {kib:>6} KiB: {seconds * 1e3:8.2f} ms ({min(times[kib]) * 1e3:.2f}-"
                  f"{max(times[kib]) * 1e3:.2f} over {rounds} rounds), bus bandwidth {_fmt(bus_gbps):>6} GB/s", flush=True)

    reduced = "all_reduce (bus bandwidth)"
    result = Comparison({reduced: Measurement(reduced, [ring * source.nbytes / s / 1e9 for s in times[sizes[-1]]]),
                         "local copy": Measurement("local copy", [source.nbytes / s / 1e9 for s in copies])},
                        unit="GB/s", cpu_only=device.type == "cpu")
    verdict = result.verdict("local copy", reduced)
    if show:
        print(f"\n{_size(sizes[-1])}: the all_reduce line above against a local copy of the same tensor, timed in the "
              f"same {rounds} rounds:", result.table(), verdict, sep="\n", flush=True)
    return {"bus_bandwidth_GBps_by_KiB": bandwidth, "time_ms_by_KiB": {k: [t * 1e3 for t in v] for k, v in times.items()},
            "compared_MiB": source.nbytes / 2**20, "comparison": result.to_dict(), "verdict": verdict}


def size_steps(metrics: dict) -> list[str]:
    """For the two smallest and the two largest sizes: bytes x4, and what the time did (medians of the rounds)."""
    ms = {int(k): statistics.median(v) for k, v in metrics["time_ms_by_KiB"].items()}
    sizes = sorted(ms)
    lines = []
    for small, large in dict.fromkeys([(sizes[0], sizes[1]), (sizes[-2], sizes[-1])]):
        grew = ms[large] / ms[small]
        what = ("the fixed cost of a call dominates (latency)" if grew < 2 else
                "the bytes dominate (bandwidth)")
        lines.append(f"{_size(small)} -> {_size(large)}: {large // small}x the bytes, {grew:.2f}x the time: {what}")
    return lines


def _size(kib: int) -> str:
    return f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"


def plot_all_reduce(metrics: dict) -> None:
    """Time per call and bus bandwidth against the message size (median and range of the rounds), with the
    local copy's bandwidth, from a run's metrics.json."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    times = {int(k): v for k, v in metrics["time_ms_by_KiB"].items()}
    kib = sorted(times)
    ring = 2 * (metrics["world_size"] - 1) / metrics["world_size"]
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(11, 3.8))
    bandwidth = [[ring * k * 1024 / (t / 1e3) / 1e9 for t in times[k]] for k in kib]
    for ax, values, ylabel in ((ax_time, [times[k] for k in kib], "time per all_reduce (ms, log scale)"),
                               (ax_bw, bandwidth, "bus bandwidth (GB/s, log scale)")):
        mid = [statistics.median(v) for v in values]
        ax.errorbar(kib, mid, yerr=[[m - min(v) for m, v in zip(mid, values)], [max(v) - m for m, v in zip(mid, values)]],
                    marker="o", color="#4C72B0", capsize=3, label="all_reduce (median, range of the rounds)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(kib, [_size(k) for k in kib])
        ax.set_xlabel("message size (log scale)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    copy = metrics["comparison"]["median"]["local copy"]
    ax_bw.axhline(copy, color="#DD8452", linestyle="--", label=f"local copy, {metrics['compared_MiB']:.0f} MiB (median)")
    ax_bw.legend(fontsize=8)
    where = "CPU numbers" if metrics["device"] == "cpu" else metrics["device"]
    fig.suptitle(f"all_reduce on {metrics['world_size']} ranks, {metrics['backend']} ({where})")
    fig.tight_layout()
    plt.show()


def torchrun_ranks(nodes: int, per_node: int) -> dict[tuple[int, int], tuple[int, int]]:
    """{(node rank, local rank): (RANK, WORLD_SIZE)} as torchrun assigns them: its own code
    (``SimpleElasticAgent._assign_worker_ranks``), run for ``nodes`` agents in threads on an in-memory store."""
    import threading
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    store = dist.HashStore()
    spec = SimpleNamespace(role="default", local_world_size=per_node)
    found = {}

    def agent(group_rank: int) -> None:
        for worker in SimpleElasticAgent._assign_worker_ranks(None, store, group_rank, nodes, spec):
            found[(group_rank, worker.local_rank)] = (worker.global_rank, worker.world_size)

    threads = [threading.Thread(target=agent, args=(g,), daemon=True) for g in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return found
