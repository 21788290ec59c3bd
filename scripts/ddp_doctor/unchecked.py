"""Why a run's check is not complete, in the words of the report's error line: the first rank that failed by an
error of its own, what a job stopped at its timeout was doing, and why a run with no mistake found checked too
little to be called clean (issue 54: never "no mistake found" about a run that checked nothing)."""

import re

from ddp_doctor import rules_sync
from ddp_doctor.report import clip
from ddp_doctor.running import Run

VICTIM = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def own_failure(run: Run) -> str:
    """The first rank that failed by an error of its own (not one that only saw another die): from the records,
    else a rank that aborted in the communication library (it left no record), else the launcher's account."""
    errors = [(rec.get("t0_ns", 0) / 1e9 + e.get("t", 0), r, e) for r, rec in run.records.items()
              for e in rec.get("errors", []) if e["in"] == "script" and not any(v in e["error"] for v in VICTIM)]
    parent = [e for e in run.parent.get("errors", []) if e.get("in") == "script"]
    if not errors and parent:  # started once as `python script`, it failed itself (before or without its ranks)
        error = parent[0]
        where = f" at {error['where']} `{error['code']}`" if error.get("where") else ""
        return f"the script's first process{where}: {clip(error['error'])}"
    if not errors:
        aborted = rules_sync.aborted(run)
        victims = [(r, e) for r, rec in sorted(run.records.items()) for e in rec.get("errors", [])[-1:]
                   if any(v in e["error"] for v in VICTIM)]
        ended = [r for r, rec in sorted(run.records.items()) if not rec.get("errors")]
        if not aborted and victims and ended:  # a rank went on to a collective after its peer had ended
            r, e = victims[0]
            where = f" at {e['where']}" if e.get("where") else ""
            return (f"rank {r} lost its peer{where}: {clip(e['error'], 160)} (rank "
                    f"{', '.join(map(str, ended))} had already ended without an error)")
        if not aborted:
            return "\n" + run.failure
        rank, text = aborted[0]
        return (f"{f'rank {rank}' if rank is not None else 'a rank'} aborted: {text}"
                + "".join(f"; then rank {r}, having only seen it die: {clip(e['error'], 160)}" for r, e in victims))
    _, rank, error = min(errors, key=lambda item: item[0])
    where = f" at {error['where']} `{error['code']}`" if error.get("where") else ""
    return f"rank {rank}{where}: {clip(error['error'])}"


def nothing_checked(run: Run) -> str:
    """Why a run that found no mistake checked too little to be called clean (issue 54), or "" when it was a
    real data-parallel run: every rank recorded, in a process group of the job's size, with an optimizer step;
    and no rank failed (a script that starts its own processes may exit 0 when they fail)."""
    job, records = run.job, run.records
    failed = sorted((r, e) for r, rec in records.items() for e in rec.get("errors", []) if e.get("in") == "script")
    if failed:
        r, e = failed[0]
        where = f" at {e['where']} `{clip(e.get('code', ''), 80)}`" if e.get("where") else ""
        return f"rank {r} failed{where}: {clip(e['error'], 200)} (the script's own exit status was {run.returncode})"
    if len(records) < job.nproc:
        return f"only {len(records)} of {job.nproc} ranks recorded anything" + _last_lines(run)
    if not any(rec.get("pg") for rec in records.values()):
        return "the script ended without making a process group: nothing distributed ran" + _last_lines(run)
    sizes = sorted({(rec.get("pg") or {}).get("world_size") for rec in records.values()}, key=str)
    if sizes != [job.nproc]:
        return f"the ranks' process groups had sizes {sizes}, not the job's {job.nproc}" + _last_lines(run)
    idle = [r for r, rec in sorted(records.items()) if not rec.get("steps")]
    if idle:
        return (f"rank {', '.join(map(str, idle))} made no optimizer step: no training was checked"
                + _last_lines(run))
    return ""


def _last_lines(run: Run, count: int = 3) -> str:
    """The script's own last output lines (the launcher's and torchrun's left out), quoted after a reason."""
    lines = [m[1].strip() for m in re.finditer(r"^(?:\[node\d+\] )?\[rank\d+\]:(.*)$", run.output, re.MULTILINE)]
    lines = list(dict.fromkeys(line for line in lines if line))[-count:]  # the ranks' own lines, each once
    return ("; its last output: " + " | ".join(clip(line, 120) for line in lines)) if lines else ""


def still_running(run: Run) -> str:
    """What the records show of a job stopped at the timeout that no rule called a hang."""
    stuck = run.stuck
    last = {(s.get("fr") or [{}])[-1].get("collective_seq_id") for s in stuck.values()}
    said = []
    for r in range(run.job.nproc):
        rec = run.records.get(r)
        errors = rec.get("errors", []) if rec else []
        if r in stuck:  # where it was: the same words as a hang's (rules_sync)
            said.append(rules_sync.stuck_line(r, rec or {"script": ""}, stuck[r]))
            continue
        said.append(f"rank {r} " + (f"had failed: {clip(errors[-1]['error'], 160)}" if errors else "had ended" if rec
                                    else "left no record"))
    if len(stuck) == run.job.nproc and len(last) == 1:
        return (f"every rank at the same collective ({'; '.join(said)}): give it a larger --timeout or fewer --steps "
                "per pass")
    return "; ".join(said)
