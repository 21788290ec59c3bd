"""The one reader of torchrun's output: rank-tagged lines, lines torchrun glued together, and its
"Root Cause" failure report; from them, the text that names the first failing rank and its cause.

    rank_lines(output)       {rank: [its lines, tags stripped]}
    report_entries(output)   torchrun's failure report, one dict per failed rank, the first failure first
    first_failure(output)    the rank that failed first: rank, signal, its own last error lines
    describe_failure(output, returncode)   the short text a LaunchError carries
    aborted_at_exit(lines)   whether a rank aborted after its script's last line (gloo's exit race)

torchrun runs with ``--tee=3 --role=rank``: every line a rank prints starts ``[rankN]:``; torch's own
error lines add a second tag (``[rank1]:[rank1]: ...``). Used by the launcher, the widget and the checker.
"""

import json
import re
import signal
from pathlib import Path

# A line a rank has not finished (a tqdm bar, redrawn after "\r" with no newline) is copied as it is, so
# the next line (another rank's, or torchrun's log) is glued to it: cut before a tag that follows text
# (not one that follows a tag: torch's errors are "[rank1]:[rank1]: ...") or before a torchrun log header.
GLUED = re.compile(r"(?<=\S)(?<!\]:)(?=\[rank\d+\]:)|(?<=\S)(?=[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ )")
# "[node] " (run_commands' label), then the rank tag, then torch's doubled tag.
TAGGED = re.compile(r"^(?:\[[^\]]*\] )?\[rank(\d+)\]:(?:\[rank\d+\]: ?)?(.*)$")
TAG = re.compile(r"\[(rank\d+)\]:(?:\[rank\d+\]: ?)?")
ENTRY = re.compile(r"rank\s+: (\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s+: (-?\d+)[^\n]*\n"
                   r"\s*error_file: ([^\n]*)\n\s*traceback : (.*?)(?=\n\[\d+\]:|\n-{20}|\n={20}|\Z)", re.DOTALL)
ROOT_CAUSE = "Root Cause (first observed failure)"
ERRORISH = re.compile(r"(^|\W)(error|exception)\b", re.IGNORECASE)
LIBRARY = ("site-packages", "/lib/python3.", '"<frozen ')
VICTIM = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer")
STOPPED_BY_TORCHRUN = "SIGTERM"  # how torchrun ends the other ranks when one fails
# A collective or store wait that ran out of time: gloo "Timed out waiting 5000ms for recv operation", nccl
# "Watchdog caught collective operation timeout", the store's "wait timeout". In a hang every rank may time out;
# the rank whose message came first is the one stuck first, whichever rank torchrun saw exit first.
TIMED_OUT = re.compile(r"timed out waiting|collective operation timeout|wait timeout|TimeoutError", re.IGNORECASE)
# A gloo worker thread that drops the last collective's tensors after Python began to exit cannot take the
# interpreter lock and aborts the process (pytorch/pytorch#117762); faulthandler then shows the main
# thread with no Python frame: the script's own code had finished.
EXIT_RACE = ("terminate called without an active exception", "<no Python frame>")
EXIT_RACE_NOTE = ("(it aborted while Python was exiting, after the script's last line: a gloo worker thread still "
                  "held a collective's tensors, torch's exit race; the script's own work was done; see notebook 03, "
                  "step 1)")


def unglue(line: str) -> list[str]:
    """``line`` cut into the lines torchrun glued together, each ending in a newline."""
    return [part if part.endswith("\n") else part + "\n" for part in GLUED.split(line) if part]


def split_tag(line: str) -> tuple[int | None, str]:
    """(rank, text) of one output line, both tags stripped; (None, line) for a line no rank printed."""
    tagged = TAGGED.match(line.rstrip("\n"))
    return (int(tagged[1]), tagged[2]) if tagged else (None, line.rstrip("\n"))


def split_chunk(chunk: str) -> list[tuple[str, str]]:
    """A chunk of output (possibly several tags and "\\r" redraws) as (tag, text) pieces, e.g.
    ("rank1", "epoch 1 ..."); tag "" for text no rank printed. Empty pieces are dropped."""
    pieces = TAG.split(chunk)  # [untagged, tag, text, tag, text, ...]
    tagged = [("", pieces[0]), *zip(pieces[1::2], pieces[2::2])]
    return [(tag, part.rstrip()) for tag, text in tagged
            for part in text.replace("\r", "\n").split("\n") if part.strip()]


def rank_lines(output: str) -> dict[int, list[str]]:
    """Each rank's lines, in order, tags stripped (torch's doubled tags too)."""
    by_rank: dict[int, list[str]] = {}
    for line in output.splitlines():
        for part in unglue(line):
            rank, text = split_tag(part)
            if rank is not None:
                by_rank.setdefault(rank, []).append(text.rstrip())
    return by_rank


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def report_entries(output: str) -> list[dict]:
    """torchrun's ChildFailedError report, one dict per failed rank, the first observed failure first:
    rank, local_rank, exitcode, signal (e.g. "SIGKILL" for exitcode -9, else None), error_file, message."""
    start = output.rfind(ROOT_CAUSE)
    if start < 0:
        return []
    block_start = output.rfind("Failures:", 0, start)
    end = output.find("=" * 20, start)
    root = output[start:end if end > 0 else None]
    others = output[block_start:start] if block_start >= 0 else ""
    entries = []
    for order, match in enumerate([*ENTRY.finditer(root), *ENTRY.finditer(others)]):
        rank, local_rank, code, error_file, message = match.groups()
        code = int(code)
        entries.append({"rank": int(rank), "local_rank": int(local_rank), "exitcode": code,
                        "signal": signal_name(-code) if code < 0 else None, "error_file": error_file.strip(),
                        "message": message.strip(), "order": order})
    return entries


def _own_lines(entry: dict, by_rank: dict[int, list[str]]) -> list[str]:
    return _from_error_file(entry) or last_error_lines(by_rank.get(entry["rank"], []))


def _is_victim(lines: list[str]) -> bool:
    return any(marker in line for line in lines for marker in VICTIM)


def timed_out_order(output: str) -> list[int]:
    """The ranks whose error lines say a wait timed out, in the order their first such line came."""
    ranks: list[int] = []
    for line in output.splitlines():
        for part in unglue(line):
            rank, text = split_tag(part)
            if rank is not None and rank not in ranks and TIMED_OUT.search(text):
                ranks.append(rank)
    return ranks


def _culprit(entries: list[dict], by_rank: dict[int, list[str]], timed_out: list[int] = ()) -> \
        tuple[dict, list[str]] | None:
    """The entry that caused the failure and its own error lines. Best first: a rank that said what went
    wrong (the one whose wait timed out first, if any did; else exit code > 0 before one stopped by
    torchrun), unless a rank killed by a signal (SIGKILL, as the out-of-memory killer does; not torchrun's
    SIGTERM) failed before it; then such a killed rank."""
    first_out = {rank: at for at, rank in enumerate(timed_out)}
    said = sorted((e for e in entries if _own_lines(e, by_rank) and not _is_victim(_own_lines(e, by_rank))),
                  key=lambda e: (first_out.get(e["rank"], len(first_out)), e["exitcode"] <= 0, e["order"]))
    killed = [e for e in entries if e["signal"] and e["signal"] != STOPPED_BY_TORCHRUN]
    if killed and (not said or killed[0]["order"] < said[0]["order"]):
        return killed[0], [line for line in _own_lines(killed[0], by_rank) if not _is_victim([line])]
    if said:
        return said[0], _own_lines(said[0], by_rank)
    return None


def first_failure(output: str) -> dict | None:
    """The rank whose failure ended the job: ``{"rank", "local_rank", "exitcode", "signal", "lines"}``
    (lines: its own last error lines, maybe []); None when the output holds no torchrun report and no rank
    said anything error-like."""
    by_rank = rank_lines(output)
    entries = report_entries(output)
    if entries:
        found = _culprit(entries, by_rank, timed_out_order(output))
        if found:
            return {**found[0], "lines": found[1]}
        first = min(entries, key=lambda e: (e["exitcode"] <= 0, e["order"]))
        return {**first, "lines": _own_lines(first, by_rank)}
    said = [(rank, last_error_lines(lines)) for rank, lines in sorted(by_rank.items())]
    said = [(rank, lines) for rank, lines in said if lines]
    if not said:
        return None
    rank, lines = min(said, key=lambda item: _is_victim(item[1]))
    return {"rank": rank, "local_rank": rank, "exitcode": None, "signal": None, "lines": lines}


def describe_failure(output: str, returncode: int | None = None) -> str:
    """A short text naming the first failing rank and its cause (its last error lines, or the signal that
    killed it); ranks that only saw it die ("Connection closed by peer") come after it, as such.

    Sources, best first: the rank's error file (torchrun's report, from @record); else that rank's own
    tagged output (a traceback, ``error: ...`` from argparse or a SystemExit). Without torchrun's report
    (torchrun itself failed) it is the rank that said something, else the output's last lines.
    """
    by_rank = rank_lines(output)
    entries = report_entries(output)
    if not entries:  # no report: torchrun itself failed, or a job that is not torchrun
        failure = first_failure(output)
        if failure:
            return f"rank {failure['rank']}" + _indent(failure["lines"])
        code = f"exit code {returncode}" if returncode is not None else "failed"
        return code + _indent(_tail(output, 12))
    timed_out = timed_out_order(output)
    found = _culprit(entries, by_rank, timed_out)
    if found is None:  # only ranks that lost a peer, or nobody said anything
        victims = [e for e in sorted(entries, key=lambda e: (e["exitcode"] <= 0, e["order"]))
                   if _own_lines(e, by_rank)]
        if victims:
            return _who(victims[0]) + _indent(_own_lines(victims[0], by_rank))
        entry = min(entries, key=lambda e: (e["exitcode"] <= 0, e["order"]))
        return f"{_who(entry)} (it printed no error)" + _indent(_tail("\n".join(by_rank.get(entry["rank"], [])), 8))
    entry, lines = found
    who = _who(entry)
    first = min(entries, key=lambda e: e["order"])
    if timed_out and entry["rank"] == timed_out[0]:  # stuck first, whatever the order the ranks exited in
        how = "torchrun then ended it by SIGTERM" if entry["signal"] == STOPPED_BY_TORCHRUN else _how(entry)
        who = f"{_who(entry).removesuffix(' ' + _how(entry))} timed out first ({how})"
    elif entry["signal"] == STOPPED_BY_TORCHRUN and first["exitcode"] > 0:  # it said why, then torchrun stopped it
        who = f"rank {entry['rank']} (stopped by torchrun after {_who(first)})"
    exit_race = entry["signal"] == "SIGABRT" and aborted_at_exit(by_rank.get(entry["rank"], []))
    if entry["signal"] and entry["signal"] != STOPPED_BY_TORCHRUN and not lines:
        who += " (killed from outside the job, e.g. by the out-of-memory killer; it printed no error)"
    text = who + _indent(lines) + ("\n" + EXIT_RACE_NOTE if exit_race else "")
    saw = [e for e in entries if e is not entry and _is_victim(_own_lines(e, by_rank))]
    if saw and entry["signal"] and entry["signal"] != STOPPED_BY_TORCHRUN:
        last = {e["rank"]: [line for line in _own_lines(e, by_rank) if _is_victim([line])][-1:] for e in saw}
        text += (f"\nthen, having only seen rank {entry['rank']} die: "
                 + "; ".join(f"rank {r}" + (f" ({_short(lines[0])})" if lines else "") for r, lines in last.items()))
    return text


def aborted_at_exit(lines: list[str]) -> bool:
    """Whether a rank's lines show gloo's exit race: an abort with no Python code running any more."""
    return all(any(mark in line for line in lines) for mark in EXIT_RACE)


def _short(line: str) -> str:
    """An error line without gloo's source location, cut after its first sentence."""
    line = re.sub(r"\[/[^\]]+\.(cc|cpp|h):\d+\] ", "", line.strip())
    return line.split(". ", 1)[0]


def _from_error_file(entry: dict) -> list[str]:
    """The traceback a rank wrote with @record: from its error file, else from the report's copy."""
    if entry["error_file"] in ("", "<N/A>"):
        return []
    text = "\n".join(line.removeprefix("  ") for line in entry["message"].splitlines())
    try:
        data = json.loads(Path(entry["error_file"]).read_text())
        message = data["message"]
        text = message["extraInfo"]["py_callstack"] if isinstance(message, dict) else str(message)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return last_error_lines([line.rstrip() for line in text.splitlines()])


def last_error_lines(lines: list[str], frames: int = 2) -> list[str]:
    """What a rank said about its failure: its last traceback (the last ``frames`` frames outside installed
    libraries, and the exception line), else its error-like lines (``error: ...``); [] if nothing."""
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent call last)")]
    if not starts:
        return [line for line in lines if ERRORISH.search(line)][-4:]
    stack, exception = [], []
    for line in lines[starts[-1] + 1:]:
        if not line.strip() or set(line.strip()) <= set("^~"):
            continue
        if not line.startswith(" "):
            exception = [line]  # the exception line ends the traceback; later lines belong to other output
            break
        if line.lstrip().startswith("File "):
            stack.append([line])
        elif stack:
            stack[-1].append(line)
    own = [frame for frame in stack if not any(lib in frame[0] for lib in LIBRARY)] or stack
    return [line for frame in own[-frames:] for line in frame] + exception


def _how(entry: dict) -> str:
    code = entry["exitcode"]
    return f"exited with code {code}" if code >= 0 else f"was ended by {entry['signal']}"


def _who(entry: dict) -> str:
    local = f" (local rank {entry['local_rank']})" if entry["local_rank"] != entry["rank"] else ""
    return f"rank {entry['rank']}{local} {_how(entry)}"


def _indent(lines: list[str]) -> str:
    return ":\n" + "\n".join("  " + line for line in lines) if lines else ""


def _tail(text: str, n: int) -> list[str]:
    return [line for line in text.rstrip().splitlines() if line.strip()][-n:]
