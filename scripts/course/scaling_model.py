"""Notebook 05's step model: the speed-up of N processes predicted from measured pieces, and its check.

One step of N processes takes its compute time plus the communication that backward did not hide:

    T_N = max(T_1, T_compute(N)) + (1 - f) * T_comm(N)        predicted speed-up = N * T_1 / T_N

T_1 is one process's step; T_compute(N) the ``no_sync`` step of N processes (each rank does the one
process's work, so it is taken as at least T_1, and the prediction can never exceed N); T_comm(N) and f are
the all-reduce time per step and its overlapped fraction, read from a profiler trace of the same N-process
configuration. The pieces are checked against each other: (1 - f) * T_comm should be what synchronising
added, T_sync(N) - T_no_sync(N), measured in the same job.
"""

from dataclasses import dataclass

AGREE = 0.20  # the model "lands" when its speed-up is within 20 % of the measured one


@dataclass
class StepModel:
    n: int
    t1: float  # s: one process, one synchronised step
    t_no_sync: float  # s: N processes, a step without the all-reduce (compute alone)
    t_sync: float  # s: N processes, a synchronised step (measured in the same job as t_no_sync)
    t_comm: float  # s: all-reduce time per step, from the trace of N processes
    overlap: float  # f: share of that all-reduce time during which backward was computing
    threads: tuple[int, int] = (1, 1)  # CPU threads of the one process, and of each of the N processes
    runs: tuple[int, int] = (1, 1)  # jobs of 1 and of N processes the medians above come from

    @property
    def compute(self) -> float:
        """The compute term: the no_sync step, and at least one process's step."""
        return max(self.t1, self.t_no_sync)

    @property
    def exposed(self) -> float:
        """Communication the model says backward could not hide: (1 - f) * T_comm."""
        return (1 - self.overlap) * self.t_comm

    def predicted(self, overlap: float | None = None) -> float:
        """N * T_1 / (compute + (1 - f) * T_comm); at most N by construction."""
        f = self.overlap if overlap is None else overlap
        return self.n * self.t1 / (self.compute + (1 - f) * self.t_comm)

    @property
    def measured(self) -> float:
        return self.n * self.t1 / self.t_sync

    def lands(self, overlap: float | None = None) -> bool:
        return abs(self.predicted(overlap) / self.measured - 1) <= AGREE

    def report(self, cpu_shared: bool) -> list[str]:
        """What the model says, and where it misses, the piece it cannot see (sentences from the numbers)."""
        ms = 1e3
        one, many = self.runs
        rests_on = f"{one} run of 1 process, {many} of {self.n}" if one == many == 1 else \
            f"medians of {one} run(s) of 1 process and {many} of {self.n}"
        lines = [(f"{self.n} processes: measured {self.measured:.2f}x ({rests_on}; whether it is a speed-up is "
                  f"the verdict's to say), predicted {self.predicted():.2f}x "
                  f"(f = 0: {self.predicted(0):.2f}x; at most {self.n} by construction)"),
                 (f"  pieces: T_sync - T_no_sync = {(self.t_sync - self.t_no_sync) * ms:.0f} ms measured; "
                  f"(1 - f) * T_comm = (1 - {self.overlap:.2f}) * {self.t_comm * ms:.0f} ms = "
                  f"{self.exposed * ms:.0f} ms modelled")]
        if self.lands():
            lines.append(f"  the prediction is within {AGREE:.0%} of the measured speed-up")
            return lines
        unseen = self.t_sync - self.compute - self.exposed
        lines.append(f"  the prediction is off by {self.predicted() / self.measured - 1:+.0%}: the model's step is "
                     f"{(self.compute + self.exposed) * ms:.0f} ms, the measured one {self.t_sync * ms:.0f} ms")
        one, each = self.threads
        if self.t_no_sync < self.t1:
            lines.append(f"  the input it cannot see: how well 1 process uses {one} thread(s) against {self.n} "
                         f"processes with {each} each. Without communication a rank's step took "
                         f"{self.t_no_sync * ms:.0f} ms, less than the one process's {self.t1 * ms:.0f} ms, which the "
                         "model rules out (it takes the compute as at least T_1)")
        elif self.lands(0):
            lines.append(f"  with f = 0 it is within {AGREE:.0%}: the overlapped all-reduce time was not hidden here")
        elif cpu_shared and unseen > 0:
            lines.append(f"  the input it cannot see ({unseen * ms:.0f} ms per step): the all-reduce runs on gloo "
                         "threads on the same CPU cores as backward, so overlapped communication still takes compute "
                         "time (and DDP copies gradients into buckets); the trace counts neither as exposed")
        else:
            lines.append(f"  {unseen * ms:+.0f} ms per step that no piece of the model holds")
        return lines
