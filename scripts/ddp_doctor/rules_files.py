"""The doctor's rules about files, from every file each rank wrote and read (the recorder's audit hook and
``torch.save``): the same file written by several ranks, files written once per simulated node, and files handed
between ranks outside the working folder.

Each rule takes the records (rank -> record) and the ``Facts`` being built, and adds findings, what it checked
and what it could not check."""

import os
import re
import tempfile

from ddp_doctor.report import Finding
from ddp_doctor.rules_data import _local_rank_hint

EVENTS = re.compile(r"events\.out\.tfevents\.")


def writes(records: dict, facts) -> None:
    """The same file (or TensorBoard folder) written by several ranks."""
    by_path: dict = {}
    folders: dict = {}
    for r, rec in records.items():
        for path in rec.get("writes", []):
            if os.path.isdir(path):  # opened to hold a file with no name (tempfile.TemporaryFile): not written
                continue
            by_path.setdefault(path, set()).add(r)
            if EVENTS.search(os.path.basename(path)):
                folders.setdefault(os.path.dirname(path), set()).add(r)
    temp = tempfile.gettempdir() + os.sep
    in_temp = sum(str(p).startswith(temp) for p in by_path)
    facts.checked.append(f"files written ({len(by_path)}"
                         + (f", {in_temp} of them in the temporary folder {temp.rstrip(os.sep)}" if in_temp else "")
                         + ")")
    shared = sorted(p for p, ranks in by_path.items() if len(ranks) > 1)
    shared_tb = sorted(f for f, ranks in folders.items() if len(ranks) > 1)
    if shared or shared_tb:
        names = _shown(shared + shared_tb, facts.cwd)
        counts = sorted({len(by_path.get(p, folders.get(p, ()))) for p in shared + shared_tb})
        facts.add(Finding(
            "rank-writes", "Several ranks write the same files: they overwrite each other (a checkpoint can be "
            "torn, a log garbled), and TensorBoard reads all ranks' event files in one folder as one series whose "
            "steps jump back.",
            f"written by {'/'.join(map(str, counts))} ranks: {names}",
            "write checkpoints, logs and TensorBoard events on rank 0 only (`if dist.get_rank() == 0:`)"
            + _local_rank_hint(records)))


def handoffs(records: dict, facts) -> None:
    """A file one rank wrote and another read, outside the working folder (the temporary folder, a fixed path):
    on one machine it works; on several each reads its own machine's copy, and two jobs share the name. The run
    cannot tell: said as unchecked (issue 54 item 6)."""
    cwd = facts.cwd.rstrip(os.sep) + os.sep
    writers: dict = {}
    for r, rec in records.items():
        for path in rec.get("writes", []):
            writers.setdefault(path, set()).add(r)
    for path in sorted(writers):
        readers = sorted(r for r, rec in records.items() if path in rec.get("reads", []) and r not in writers[path])
        if readers and not path.startswith(cwd):
            facts.unchecked.append(
                f"a file handed between ranks outside the working folder: rank {'/'.join(map(str, sorted(writers[path])))}"
                f" wrote {path} and rank {', '.join(map(str, readers))} read it; here all ranks share one machine, but "
                "on several nodes each reads its own machine's copy (missing or stale), and two jobs on one machine "
                "use the same name (broadcast the object, or write it in a folder every node sees, named per job)")
            return


LOCAL_ZERO = re.compile(r"(?i)\b(local_rank|gpu_id)\W{0,4}==\s*0\b")  # `if self.gpu_id == 0:` (the tutorials' name)


def node_local_writes(records: dict, source: str, facts) -> None:
    """Files that each simulated node's LOCAL_RANK 0 wrote, from a script that saves where LOCAL_RANK is 0 (read
    from its source): right on one node or with node-local disks, wrong on nodes sharing a filesystem. The run
    cannot tell which the learner has: said as unchecked, not as a mistake. A file whose writing lines (the
    recorder's sites) are under no such test stays a mistake: every rank writes it, on one node as on several."""
    found = next((f for f in facts.findings if f.code == "rank-writes"), None)
    nodes = {rec["env"].get("GROUP_RANK") for rec in records.values()}
    if found is None or len(nodes) < 2 or not LOCAL_ZERO.search(source) \
            or any((rec["env"].get("LOCAL_RANK") or "0") != "0" for rec in records.values() if rec.get("writes")):
        return
    by_path: dict = {}
    for rec in records.values():
        for path in rec.get("writes", []):
            by_path.setdefault(path, []).append(rec.get("sites", {}).get(path))
    shared = sorted(p for p, sites in by_path.items() if len(sites) > 1)
    sources: dict = {}  # file -> its lines, read once
    everywhere = [p for p in shared if all(sites and not _under_local_zero(sites, sources) for sites in by_path[p])]
    local = [p for p in shared if p not in everywhere]
    facts.findings.remove(found)
    if everywhere:
        found.evidence = (f"written by {len(by_path[everywhere[0]])} ranks, from lines under no LOCAL_RANK test: "
                          + _shown(everywhere, facts.cwd))
        facts.add(found)
    if local or not everywhere:
        shown = f"{len(nodes)} ranks: {_shown(local, facts.cwd)}" if local else found.evidence.removeprefix("written by ")
        facts.unchecked.append(
            f"whether your nodes share a filesystem: the script saves where LOCAL_RANK is 0 (read from its source), "
            f"so the first process of each of the doctor's {len(nodes)} simulated nodes wrote the same files "
            f"({shown}): right on one node or with node-local disks; on nodes sharing a filesystem they overwrite "
            "each other (save on RANK 0 there)")


def _shown(paths: list, cwd: str) -> str:
    """The first 4 paths, relative to the working folder where they are inside it."""
    names = [os.path.relpath(p, cwd) if p.startswith(cwd) else p for p in paths]
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


def _under_local_zero(sites: list, sources: dict) -> bool:
    """Whether one of these [file, line] of the script tests LOCAL_RANK == 0, or sits in a block that does."""
    for file, line in sites:
        if file not in sources:
            try:
                with open(file, encoding="utf-8", errors="replace") as f:
                    sources[file] = f.read().splitlines()
            except OSError:
                sources[file] = None
        if sources[file] is None:
            return True  # cannot tell: as before, a node-local save
        lines = sources[file][:line]
        indent = len(lines[-1]) - len(lines[-1].lstrip()) + 1 if lines else 0
        for text in reversed(lines):
            depth = len(text) - len(text.lstrip())
            if not text.strip() or text.lstrip().startswith("#") or depth >= indent:
                continue
            if LOCAL_ZERO.search(text):
                return True
            indent = depth
            if text.lstrip().startswith(("def ", "async def ", "class ")):
                break
    return False
