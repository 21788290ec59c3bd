"""What the live stream shows of torchrun's output, line by line: the ranks' lines (once, when every rank
prints the same error), not torchrun's own failure report. Everything is kept in the job's output.

Held back from the stream (kept in the output):
- torchrun's traceback that ends in ChildFailedError, the report block after it, and its log lines
  about the failure; when torchrun is told to stop (a timeout, Stop, an interrupt), its shutdown log lines
  and its traceback that ends in SignalException. A traceback of torchrun that ends in anything else (a bad
  option) is the cause: shown.
- a rank's error lines (from ``usage:``, ``Traceback``, or an ``error:`` line on) that repeat, line for
  line, what another rank printed: argparse's usage and error from every rank show once, and one line at
  the end says how many ranks printed the same.
"""

import re

from ddp_doctor.runner.torchrun_output import ERRORISH, ROOT_CAUSE, split_tag

# torch 2.14 on Python 3.11+ logs the agent's signal as a number ("Received 15 death signal, shutting down
# workers", elastic/agent/server/api.py); older Pythons printed "Signals.SIGTERM".
LOG = re.compile(r"^[WEI]\d{4} .*\] (failed \(exitcode|no error file defined|Sending process \d+ closing|"
                 r"Received (Signals\.)?(SIG\w+|\d+) death signal)")
HIDDEN_ENDINGS = ("ChildFailedError", "SignalException")
BOTH, KEEP, SHOW = "both", "keep", "show"


class TorchrunStream:
    """Feed each line (``feed``), then ``flush`` at the end: each returns [(line, how)], how one of
    "both" (show it and keep it in the output), "keep" (only keep it) or "show" (only show it: kept before)."""

    def __init__(self):
        self.held: list[str] = []  # a torchrun traceback, until its last line says what it is
        self.in_report = False
        self.seen_root = False
        self.same = _SameErrors()

    def feed(self, line: str) -> list[tuple[str, bool]]:
        if self.in_report:
            if line.startswith(ROOT_CAUSE):
                self.seen_root = True
            elif self.seen_root and line.startswith("====="):
                self.in_report = self.seen_root = False
            return [(line, KEEP)]
        if self.held:
            if line.startswith((" ", "Traceback")) or not line.strip():
                self.held.append(line)
                return []
            held, self.held = self.held, []
            if any(ending in line for ending in HIDDEN_ENDINGS):
                self.in_report = "ChildFailedError" in line
                return [(text, KEEP) for text in [*held, line]]
            return [(text, BOTH) for text in [*held, line]]
        if line.startswith("Traceback (most recent call last):"):
            self.held = [line]
            return []
        if LOG.match(line):
            return [(line, KEEP)]
        return self.same.feed(line)

    def flush(self) -> list[tuple[str, bool]]:
        held, self.held = self.held, []
        return [(text, BOTH) for text in held] + self.same.flush()


class _SameErrors:
    """Shows a rank's error block once when other ranks print the same block, line for line."""

    START = re.compile(r"^(usage: |Traceback \(most recent call last\))")

    def __init__(self):
        self.block: dict[int, list[str]] = {}  # rank -> its error block so far (texts, tags stripped)
        self.held: dict[int, list[str]] = {}  # rank -> its lines held back (whole lines)
        self.diverged: set[int] = set()
        self.first: list[str] = []  # the block as first printed, by whichever rank got there first

    def feed(self, line: str) -> list[tuple[str, bool]]:
        rank, text = split_tag(line)
        if rank is None or rank in self.diverged:
            return [(line, BOTH)]
        if rank not in self.block:
            if not (self.START.match(text.lstrip()) or ERRORISH.search(text)):
                return [(line, BOTH)]
            self.block[rank], self.held[rank] = [], []
        at = len(self.block[rank])
        self.block[rank].append(text)
        if at == len(self.first):  # this rank is the first to print this line of the block
            self.first.append(text)
            return [(line, BOTH)]
        if self.first[at] == text:  # the same as another rank printed
            self.held[rank].append(line)
            return [(line, KEEP)]
        self.diverged.add(rank)  # it says something else: show what was held back, then go on
        held, self.held[rank] = self.held[rank], []
        return [(text, SHOW) for text in held] + [(line, BOTH)]

    def flush(self) -> list[tuple[str, bool]]:
        same = sorted(rank for rank, held in self.held.items() if held and rank not in self.diverged)
        if not same:
            return []
        ranks = ", ".join(map(str, same))
        count = max(len(self.held[rank]) for rank in same)
        who = f"rank {ranks}" if len(same) == 1 else f"ranks {ranks}"
        text = f"[launcher] {who} printed the same {count} line(s) as shown above (shown once; all in the full output)\n"
        return [(text, BOTH)]
