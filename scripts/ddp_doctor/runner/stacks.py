"""Where each rank was when a job timed out: every rank the launcher starts dumps its Python stack on request
(``startup/_course_stacks.py``: ``faulthandler`` on SIGUSR2, a file per rank in the job's folder). Read here:

    folder = new_folder()                 # given to the job's processes as COURSE_STACKS_DIR
    ask(folder, pids)                     # at the launcher's timeout: every rank dumps its stack (waits briefly)
    places = read(folder)                 # {rank: Place}: the ranks that dumped
    text = describe(places)               # one line per rank, and the rank that never reached the collective

A rank's place: its innermost line in the script (the outermost file of its own code on the stack: the launched
script, or the learner's script under the course's recorder), with the code line; the innermost line of its own
code elsewhere if deeper (a helper module); whether it was inside a collective (the innermost ``torch.distributed``
call on its stack, or DistributedDataParallel's forward) or waiting for a DataLoader batch.
"""

import linecache
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ddp_doctor.runner.processes import log_folder
from ddp_doctor.runner.startup import _course_stacks as rank_side  # the ranks' side: registering, asking
from ddp_doctor.runner.torchrun_output import _short

ENV, ASKED = rank_side.ENV, rank_side.ASKED
THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
HELPERS = tuple(str(Path(__file__).parents[1] / d) + os.sep for d in ("recorder", "launcher"))  # ours, not the script's
LIBRARY = ("site-packages", "dist-packages", os.sep + "lib" + os.sep + "python3.")
DISTRIBUTED = (os.sep + "torch" + os.sep + "distributed" + os.sep,)
WRAPPERS = ("wrapper", "_fn", "inner")  # torch.distributed's logging and deprecation decorators: not the call
DDP = os.sep + os.path.join("torch", "nn", "parallel", "distributed.py")
LOADER = os.sep + os.path.join("torch", "utils", "data", "dataloader.py")
AUTOGRAD = os.sep + os.path.join("torch", "autograd") + os.sep


@dataclass
class Place:
    rank: int
    frames: list = field(default_factory=list)  # (file, line, function) of its main thread, innermost first
    asked: str = ""  # the error that made this rank ask the others (its wait timed out); "" if it was asked

    def _own(self) -> list:
        """Its own frames, innermost first: not a library's, and none outside the recorder (what started the
        recorder, e.g. the exercise checker's forked rank, is not the script)."""
        helpers = [i for i, f in enumerate(self.frames) if f[0].startswith(HELPERS)]
        inside = self.frames[:helpers[-1]] if helpers else self.frames
        return [f for f in inside if not _library(f[0])]

    @property
    def site(self):
        """(file, line) of its innermost line in the script (the outermost file of its own code); None if none."""
        own = self._own()
        if not own:
            return None
        script = own[-1][0]
        return next((f[0], f[1]) for f in own if f[0] == script)

    @property
    def deeper(self):
        """(file, line) of its innermost own line when that is in another file than the script's; else None."""
        own = self._own()
        return (own[0][0], own[0][1]) if own and own[0][0] != own[-1][0] else None

    @property
    def collective(self) -> str:
        """The torch.distributed call it was in (e.g. "all_reduce"), DDP's forward, or ""."""
        for file, _, function in self.frames:
            if any(d in file for d in DISTRIBUTED) and function not in WRAPPERS and not function.startswith("_"):
                return function
            if file.endswith(DDP):
                return f"DistributedDataParallel's forward ({function})"
        return ""

    @property
    def in_backward(self) -> bool:
        """Inside backward(): DDP all-reduces the gradients there, in C++ (no Python frame says whether it waits)."""
        return not self.collective and any(AUTOGRAD in f[0] for f in self.frames)

    @property
    def waiting_for_data(self) -> bool:
        return not self.collective and any(f[0].endswith(LOADER) for f in self.frames)

    def line(self) -> str:
        """e.g. "rank 0 in all_reduce at hang.py:9 `dist.all_reduce(t)`"; "rank 1 at hang.py:12 `time.sleep(60)`,
        in no collective"."""
        where = f"at {_at(self.site)}" if self.site else "outside its own code (no line of the script on its stack)"
        deeper = f" (deeper: {_at(self.deeper)})" if self.deeper else ""
        if self.collective:
            return f"rank {self.rank} in {self.collective} {where}{deeper}"
        if self.asked:  # asked by another rank while it handled its own timeout
            return f"rank {self.rank} {where}{deeper}, where its own wait timed out"
        if self.in_backward:
            return (f"rank {self.rank} in backward() {where}{deeper} (where DDP all-reduces the gradients, "
                    "if the model is wrapped in DDP)")
        data = " (inside its DataLoader, getting the next batch)" if self.waiting_for_data else ""
        return f"rank {self.rank} {where}{deeper}{data}, in no collective"


def _library(file: str) -> bool:
    return file.startswith("<") or file.startswith(HELPERS) or any(p in file for p in LIBRARY)


def _at(site) -> str:
    file, line = site
    code = linecache.getline(file, line).strip()
    return f"{os.path.basename(file)}:{line}" + (f" `{code}`" if code else "")


def new_folder() -> str:
    """A folder for the job's stacks, named after this process (removed with the job, or by a later launch)."""
    return log_folder()


def ask(folder: str, pids, wait: float = 3.0) -> list[str]:
    """Every rank among ``pids`` dumps its stack into ``folder``; returns once they have (``wait`` s at most), with
    the files of the ranks asked."""
    return rank_side.ask(folder, set(pids), wait)


def parse(text: str) -> tuple[list, str]:
    """(frames of the main thread in the last dump, innermost first; what the rank asked, or "") of a rank's file."""
    lines = text.splitlines()
    main = lines[0].split()[-1] if lines and lines[0].startswith("main thread ") else None
    asked = next((line[len(ASKED):] for line in lines if line.startswith(ASKED)), "")
    blocks, current = {}, None
    for line in lines[1:]:
        thread = THREAD.match(line)
        if thread:
            current = blocks[thread[1]] = []  # a later dump replaces an earlier one
        elif current is not None and (frame := FRAME.match(line)):
            current.append((frame[1], int(frame[2]), frame[3]))
    if main in blocks:
        return blocks[main], asked
    return (list(blocks.values())[-1] if blocks else []), asked  # faulthandler lists the main thread last


def read(folder: str) -> dict:
    """{rank: Place} of the ranks that dumped their stack or asked the others (the last process of each rank)."""
    places = {}
    for rank, _, _, path in sorted(rank_side.registered(folder), key=lambda r: os.path.getmtime(r[3])):
        try:
            frames, asked = parse(Path(path).read_text(errors="replace"))
        except OSError:
            continue
        if frames or asked:
            places[rank] = Place(rank, frames, asked)
    return places


def describe(places: dict, silent=()) -> str:
    """Where each rank was, one line each, and the rank that never reached the collective the others wait in;
    "" when no rank said. ``silent``: ranks that were asked and did not answer."""
    if not places and not silent:
        return ""
    askers = [p for _, p in sorted(places.items()) if p.asked]
    shown = [p for _, p in sorted(places.items()) if p.frames and (p.site or not p.asked)]  # an asker: its traceback
    if askers:
        head = f"when rank {askers[0].rank}'s wait timed out ({_short(askers[0].asked)})" + "".join(
            f", and rank {p.rank}'s ({_short(p.asked)})" for p in askers[1:])
        head += (", the other ranks were:" if shown and not any(p.asked for p in shown) else
                 ", the ranks were:" if shown else ", no other rank said where it was (each had ended, or was ending)")
    else:
        head = "where each rank was when the job was stopped:"
    lines = [head, *("  " + p.line() for p in shown)]
    lines += [f"  rank {r}: no stack (it did not answer within the wait)" for r in sorted(silent)]
    waiting = [p for p in places.values() if p.collective or p.asked]
    never = [p for p in shown if not (p.collective or p.in_backward or p.asked)]
    if waiting and never:
        waited = ", ".join(f"rank {p.rank} waited in {p.collective}" if p.collective else
                           f"rank {p.rank}'s wait timed out" for p in sorted(waiting, key=lambda p: p.rank))
        lines.append("the rank that never reached the collective: "
                     + "; ".join(f"rank {p.rank}, at {_at(p.site) if p.site else 'a line outside its code'}"
                                 for p in never) + f" ({waited})")
    return "\n".join(lines)


def where_ranks_were(folder: str, asked=()) -> str:
    """``describe`` of what the ranks in ``folder`` wrote; ``asked``: the files of the ranks the launcher asked."""
    places = read(folder)
    silent = {rank for rank, _, _, path in rank_side.registered(folder) if path in asked} - set(places)
    return describe(places, silent)


def one_line(text: str) -> str:
    """``describe``'s text as one sentence (a verdict's): its head, then its lines joined by "; "."""
    head, *rest = text.splitlines() or [""]
    joined = head + (" " + "; ".join(line.strip() for line in rest) if rest else "")
    return (joined[:1].upper() + joined[1:] + ".") if joined else ""
