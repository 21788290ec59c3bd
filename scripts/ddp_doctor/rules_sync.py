"""The doctor's rules about the process group and what the ranks share, each made from what the run did: the
process group and devices, the replicas (parameter fingerprints compared across ranks every step), the averaged
gradients (why not, from what DDP did: ``rules_ddp``), hangs (where every rank was, from the recorder's
dump and the flight recorder), collectives that do not match (flight recorder, or gloo aborting a rank on it)."""

import os
import re

from ddp_doctor.report import Finding, clip
from ddp_doctor.rules_ddp import why_not_averaged

RTOL = 1e-6  # fingerprints of replicas agree to float rounding; every mistake looked for is far larger
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single")
# A wait that ran out: a hang. ("Connection closed by peer" is not one: it is a rank that saw another die.)
HUNG = ("Timed out", "timed out", "DistStoreError", "wait timeout")
# a collective that failed because a peer left it (after that peer's wait timed out, or as it exited)
PEER = ("Connection closed by peer", "pair closure", "Connection reset by peer")


def _same(a, b) -> bool:
    if a is None or b is None:
        return True
    return all(abs(x - y) <= RTOL * (abs(x) + abs(y)) + 1e-12 for x, y in zip(a, b))


def process_group(records: dict, facts) -> bool:
    """Every rank in one process group of the launched size; False: nothing distributed to check further."""
    n = len(records)
    pgs = {r: rec.get("pg") for r, rec in records.items()}
    trained = any(rec.get("forwards") or rec.get("steps") for rec in records.values())
    if all(pg is None for pg in pgs.values()):
        if trained:
            facts.add(Finding("not-distributed", f"No process called init_process_group: each of the {n} "
                              "processes trained alone, on the same data, and nothing was shared.",
                              f"{n} processes ran; none called torch.distributed.init_process_group",
                              "initialise the process group and wrap the model in DistributedDataParallel"))
        return False
    facts.checked.append("process group")
    sizes = {pg["world_size"] for pg in pgs.values() if pg and "world_size" in pg}
    if sizes and max(sizes) < n:
        facts.add(Finding("not-distributed", f"The process group is smaller than the job: {n} processes, each in a "
                          f"group of {max(sizes)}.", f"init_process_group ended with world size {sorted(sizes)} "
                          f"on {n} processes launched", "let init_process_group read RANK and WORLD_SIZE from "
                          "torchrun (no rank= or world_size= by hand)"))
        return False
    for r, pg in sorted(pgs.items()):
        env_rank = records[r]["env"].get("RANK")
        if pg and pg.get("rank_arg") is not None and str(pg["rank_arg"]) != str(env_rank):
            facts.add(Finding("local-rank", "A process joined the group with a rank torchrun did not give it.",
                              f"torchrun's RANK={env_rank}, init_process_group(rank={pg['rank_arg']}) at "
                              f"{pg['where']} (LOCAL_RANK={records[r]['env'].get('LOCAL_RANK')})",
                              "use RANK (dist.get_rank()) as the global rank; LOCAL_RANK only picks the device"))
            break
    return True


def devices(records: dict, facts) -> None:
    found = {r: rec["modules"][0]["device"] for r, rec in records.items() if rec.get("modules")}
    if len(found) == len(records) > 1:
        facts.checked.append("devices")
        one = set(found.values())
        if len(one) == 1 and not next(iter(one)).startswith("cpu"):
            facts.add(Finding("same-device", "Every rank trains on the same accelerator.",
                              f"the model of every rank is on {next(iter(one))}",
                              "torch.cuda.set_device(local_rank) (or device=f'cuda:{local_rank}') before "
                              "building the model"))


def model_parallel(records: dict) -> str:
    """Why the ranks' models are not replicas (pipeline, experts, tensor parallel, sharded), or ''."""
    for rec in records.values():
        names = {c["op"] for c in rec.get("collectives", [])}
        names |= {(e.get("profiling_name") or "").split(":")[-1] for e in rec.get("fr", [])}
        if names & set(P2P) or any(e.get("is_p2p") for e in rec.get("fr", [])):
            return "point-to-point or all-to-all communication (pipeline or expert parallelism)"
        if any(c.get("in_forward") and not c.get("internal") and c["op"] in ("all_reduce", "all_gather")
               for c in rec.get("collectives", [])):
            return "collectives inside the forward pass (tensor parallelism)"
        if any(m["sharded"] and not m["class"].startswith("FSDP") for m in rec.get("modules", [])):
            return "parameters split by tensor parallelism"
    shapes = {tuple(map(tuple, m["shapes"])) for rec in records.values() for m in rec.get("modules", [])[:1]}
    return "the ranks' models differ in shape" if len(shapes) > 1 else ""


def sharded(records: dict) -> bool:
    """FSDP: each rank holds a shard of every parameter (data parallel, but no replicas to compare)."""
    return any(m["sharded"] for rec in records.values() for m in rec.get("modules", []))


def replicas(records: dict, facts) -> None:
    """Parameters equal on every rank at the first training step, and after every optimizer step."""
    ranks = sorted(records)
    per = {r: {(p["m"], p["step"]): p["fp"] for p in records[r].get("params", [])} for r in ranks}
    keys = sorted(set.intersection(*(set(v) for v in per.values()))) if per else []
    if not keys:
        facts.unchecked.append("replicas (no training forward on every rank)")
        return
    modules = records[ranks[0]]["modules"]
    facts.checked.append(f"replicas ({len(keys)} fingerprints of the parameters per rank)")
    for key in keys:
        names = modules[key[0]]["names"]
        bad = [n for i, n in enumerate(names) if not all(_same(per[r][key][i], per[ranks[0]][key][i]) for r in ranks)]
        if not bad:
            continue
        where = f"{len(bad)} of {len(names)} parameters differ ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})"
        if key[1] == 0 and all(records[r].get("ddp") for r in ranks):
            facts.add(Finding("replicas-start", "The ranks start from different weights although the model is "
                              "wrapped in DDP: they were changed on some ranks after DDP was built (DDP copies "
                              "rank 0's weights to every rank only when it is built).",
                              f"at the first training step {where} between ranks; every rank had built its "
                              "DistributedDataParallel before", "change the weights before wrapping the model in "
                              "DDP, or the same way on every rank (load a checkpoint on every rank)"))
        elif key[1] == 0:
            facts.add(Finding("replicas-start", "The ranks start from different weights.",
                              f"at the first training step {where} between ranks",
                              "wrap the model in DistributedDataParallel, which copies rank 0's weights to "
                              "every rank at construction (or broadcast them yourself)"))
        elif not any(f.code in ("grads-not-averaged", "grads-scaled") for f in facts.findings):
            facts.add(Finding("replicas-drift", "The replicas drift apart: equal before an optimizer step, "
                              "different after it.", f"after optimizer step {key[1]} {where}",
                              "every rank must apply the same update: average the gradients on every rank, and "
                              "keep per-rank state that changes the step (a GradScaler, a scheduler) identical"))
        return


def gradients(records: dict, facts) -> None:
    """Just before each optimizer step, every parameter's gradient equal on every rank (averaged)."""
    ranks = sorted(records)
    per = {r: {(g["opt"], g["step"]): g for g in records[r].get("grads", [])} for r in ranks}
    keys = sorted(set.intersection(*(set(v) for v in per.values()))) if per else []
    if not keys:
        facts.unchecked.append("gradients (no optimizer step on every rank)")
        return
    facts.checked.append(f"gradients before {len(keys)} optimizer steps")
    for key in keys:
        g0 = per[ranks[0]][key]
        differ = [i for i in range(len(g0["names"])) if not all(_same(per[r][key]["fp"][i], g0["fp"][i]) for r in ranks)]
        bad = [g0["names"][i] for i in differ]
        if bad:
            factors = _factors(per, ranks, key, differ)
            if factors:
                facts.add(Finding(
                    "grads-scaled", "Every rank applies the averaged gradient times a factor of its own, so the "
                    "replicas drift apart.", f"before optimizer step {key[1]} the gradients of rank "
                    + ", ".join(f"{r} are {f:.4g}x" for r, f in factors.items()) + f" rank {ranks[0]}'s ({', '.join(bad[:3])})",
                    "keep per-rank state that scales the gradients identical on every rank: a "
                    "GradScaler restored from a checkpoint on one rank only, or any per-rank division of `.grad` "
                    "after the all-reduce"))
                return
            every = len(bad) == len(g0["names"])
            seen, fix = why_not_averaged(records, g0)
            facts.add(Finding(
                "grads-not-averaged", "The gradients are not averaged across ranks" + (
                    ": every rank steps with its own" if every else f": {len(bad)} of {len(g0['names'])} "
                    "parameters are left out of the averaging") + seen,
                f"before optimizer step {key[1]} the gradients of {', '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''} differ between ranks", fix))
            return


def _factors(per: dict, ranks: list, key, bad: list) -> dict:
    """{rank: factor} when each rank's differing gradients (positions ``bad``) are rank 0's times one factor of
    its own (else {})."""
    base = [per[ranks[0]][key]["fp"][i] for i in bad]
    found = {}
    for r in ranks[1:]:
        mine = [per[r][key]["fp"][i] for i in bad]
        ratios = [fp[0] / b[0] for fp, b in zip(mine, base) if fp is not None and b is not None and abs(b[0]) > 1e-12]
        if not ratios or any(abs(x - ratios[0]) > 1e-4 * abs(ratios[0]) for x in ratios):
            return {}
        found[r] = ratios[0]
    return found if any(abs(f - 1) > 1e-4 for f in found.values()) else {}


def stuck_line(r: int, rec: dict, stuck: dict) -> str:
    script = rec.get("script", "")
    frames = [f for f in stuck.get("stack", []) if f["file"] == script]
    where = f"{os.path.basename(script)}:{frames[-1]['line']}" if frames else "outside the script"
    current = stuck.get("current") or {}
    fr = stuck.get("fr") or rec.get("fr") or []
    if not current and not fr:
        return f"rank {r} at {where}, in no collective"
    op = current.get("op") or (fr[-1].get("profiling_name") or "?").split(":")[-1]
    seq = fr[-1].get("collective_seq_id") if fr else None
    return f"rank {r} in {op} at {where}" + (f" (its collective #{seq})" if seq else "")


def _error_line(r: int, rec: dict, causes=HUNG) -> str:
    """Where a rank was when its wait ended in a timeout (``causes``: PEER, its peer's leaving)."""
    failed = [c for c in rec.get("collectives", []) if any(h in c.get("error", "") for h in causes)]
    if failed:
        return f"rank {r} in {failed[-1]['op']} at {failed[-1]['where']}"
    errors = [e for e in rec.get("errors", []) if any(h in e["error"] for h in causes)]
    if not errors:
        return ""
    pg = rec.get("pg") or {}
    if pg and "rank" not in pg:  # init_process_group never returned
        return f"rank {r} in init_process_group at {pg['where']}"
    if errors[0]["in"] == "backward":
        return f"rank {r} in DDP's gradient all-reduce, in backward() at {errors[0]['where']}"
    fr = rec.get("fr") or []
    op = (fr[-1].get("profiling_name") or "?").split(":")[-1] if fr else "a collective"
    return f"rank {r} in {op} at {errors[0]['where']}"


def _fr_ops(rec: dict) -> dict:
    """seq id -> (collective, input sizes) of the default process group, from the flight recorder."""
    return {e["collective_seq_id"]: ((e.get("profiling_name") or "?").split(":")[-1], e.get("input_sizes"))
            for e in rec.get("fr", []) if not e.get("is_p2p") and (e.get("process_group") or ["0"])[0] == "0"}


def _mismatch(records: dict) -> str:
    """The first collective the ranks did not agree on (flight recorder), or ''."""
    ops = {r: _fr_ops(rec) for r, rec in sorted(records.items())}
    if len(ops) < 2 or not all(ops.values()):
        return ""
    for seq in sorted(set.intersection(*(set(o) for o in ops.values()))):
        seen = {r: o[seq] for r, o in ops.items()}
        names = {name for name, _ in seen.values()}
        sized = names <= {"all_reduce", "broadcast"}  # their tensors must match; gather/scatter differ by rank
        if len(names) > 1 or (sized and len({str(sizes) for _, sizes in seen.values()}) > 1):
            return f"collective #{seq}: " + "; ".join(f"rank {r} called {name} of {sizes}"
                                                       for r, (name, sizes) in seen.items())
    return ""


def hangs(run, facts) -> bool:
    """A hang or a mismatched collective: where every rank was. True when one was found."""
    mismatch = _mismatch(run.records)
    if run.timed_out and run.stuck:
        last = {(s.get("fr") or [{}])[-1].get("collective_seq_id") for s in run.stuck.values()}
        if len(run.stuck) == run.job.nproc and len(last) == 1:  # every rank at the same collective: in step
            return False
        where = [stuck_line(r, run.records.get(r, {"script": ""}), s) for r, s in sorted(run.stuck.items())]
    else:
        lines = {r: _error_line(r, rec) for r, rec in sorted(run.records.items())}
        if any(lines.values()):  # a rank's wait timed out: where the others were then, from the collective its
            for r in sorted(set(run.records) | set(run.stuck)):  # peer's leaving ended, or its stuck_rank<N>.json
                rec = run.records.get(r, {"script": ""})
                lines[r] = lines.get(r) or _error_line(r, rec, PEER) or (
                    stuck_line(r, rec, run.stuck[r]) if r in run.stuck else "")
        where = [w for _, w in sorted(lines.items()) if w]
    if mismatch:
        facts.add(Finding("collective-mismatch", "The ranks called different collectives at the same point.",
                          mismatch + (" (" + "; ".join(where) + ")" if where else "") + " (flight recorder)",
                          "every rank must call the same collectives in the same order: look for one inside an "
                          "`if` on the rank"))
        return True
    if not where:
        return False
    facts.add(Finding("hang", "The job hung: a rank waited in a collective that another rank never joined"
                      + (f" (stopped after {run.job.timeout:.0f} s)." if run.timed_out else
                         f" (the {run.job.hang_after:.0f} s process-group timeout ended it)."),
                      "; ".join(where), "every rank must call every collective, as often and in the same order: "
                      "look for a collective inside an `if` on the rank, or loops of different lengths"))
    return True


def own_error(run, facts) -> None:
    """A failure of the script's own that names a data-parallel mistake."""
    text = run.failure or ""
    match = re.search(r"[^\n]*(Expected all tensors to be on the same device|is not on the expected device)[^\n]*",
                      text)
    if match:
        facts.add(Finding("device-mismatch", "A tensor the model uses is on another device than the model.",
                          clip(match[0], 200), "move it with the model: register it as a buffer (self.register_buffer) "
                          "or create it with device=...; a loss's class weights go to the device too"))


# A rank that aborts in a collective (a C++ exception: no Python traceback, no record) says why on one line.
ABORT = re.compile(r"what\(\):\s*(?:\[enforce fail at [^\]]*\]\s*)?(.*)")
MISMATCH = ("Is there a distributed collective mismatch", "Received data size doesn't match")


def aborted(run) -> list:
    """[(rank or None, message)] for the ranks that aborted inside the communication library (no record left):
    the rank is the one without a record when exactly one is missing."""
    found = [clip(m[1]) for m in ABORT.finditer(run.output or "")]
    missing = sorted(set(range(run.job.nproc)) - set(run.records))
    return [(missing[0] if len(missing) == 1 else None, text) for text in dict.fromkeys(found)]


def aborted_mismatch(run, facts) -> None:
    """gloo's own word that the ranks' collectives did not match (a rank aborted on it)."""
    for rank, text in aborted(run):
        if any(m in text for m in MISMATCH):
            who = f"rank {rank}" if rank is not None else "a rank"
            facts.add(Finding("collective-mismatch", "The ranks called different collectives at the same point.",
                              f"{who} aborted in gloo: {text}", "every rank must call the same collectives in the "
                              "same order, as often: look for one inside an `if` on the rank, or loops of "
                              "different lengths (shards of different sizes)"))
            return
