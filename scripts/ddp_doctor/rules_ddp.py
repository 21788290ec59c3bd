"""The doctor's rules about what DistributedDataParallel did, each made from what the run did: gradient
accumulation (one all-reduce per optimizer step), its costly settings, evaluation through the wrapper on some
ranks only (buffers broadcast), and why gradients were not averaged in a model that DDP wraps."""

from ddp_doctor.report import COST, Finding


def why_not_averaged(records: dict, grads: dict) -> tuple:
    """(the cause's sentence, the fix) for gradients that differ between ranks, from what DDP did."""
    ddps = [rec.get("ddp") for rec in records.values()]
    if not all(ddps):
        return ".", ("wrap the model in DistributedDataParallel (or all_reduce every parameter's .grad and divide "
                     "by the world size)")
    trained = {m["class"] for rec in records.values() for m in rec.get("modules", [])}
    if trained and "DistributedDataParallel" not in trained:
        return ((f", although the model is wrapped in DDP: the training forward calls the inner model "
                f"({', '.join(sorted(trained))}, e.g. model.module(x)), so DDP's gradient hooks do nothing: DDP "
                "expects a backward only after a forward through the wrapper."),
                "call the DDP-wrapped model in training (model(x), not model.module(x))")
    unused = [n for n, fp in zip(grads["names"], grads["fp"]) if fp is None]
    if unused and not any(d["find_unused_parameters"] for d in ddps[0]):
        return ((f", although the model is wrapped in DDP: {len(unused)} parameter(s) got no gradient "
                f"({', '.join(unused[:3])}) and DDP, built with find_unused_parameters=False, waits for them, so "
                "it never all-reduces their bucket (and fails at the next forward)."),
                "build DDP with find_unused_parameters=True, or let every parameter take part in the loss")
    return (", although the model is wrapped in DDP.", ("let DDP's backward run on every rank: no "
            "model.no_sync() or require_backward_grad_sync=False on the step's last backward"))


def accumulation(records: dict, facts) -> None:
    """Several backward passes per optimizer step: the loss divided by their number, and one all-reduce."""
    rec = records[min(records)]
    steps: dict = {}
    for loss in rec.get("losses", []):
        steps.setdefault(loss["step"], []).append(loss)
    done = {s: ls for s, ls in steps.items() if s < len(rec.get("steps", []))}  # steps that were taken
    multi = {s: ls for s, ls in done.items() if len(ls) > 1}
    if len(multi) * 2 <= len(done):  # accumulation is every step's pattern (a skipped step adds one backward)
        return
    k = max(len(ls) for ls in multi.values())
    facts.checked.append(f"gradient accumulation ({k} backward passes per optimizer step)")
    undivided = [ls for ls in multi.values() if all(abs(x["f"] - 1) < 1e-6 and x["root"] and
                                                    x["root"].endswith(("LossBackward0", "MeanBackward0",
                                                                        "MeanBackward1")) for x in ls)]
    if undivided:
        facts.add(Finding(
            "accum-not-divided", f"Accumulated gradients are {k}x the mean: each of the {k} micro-batch losses is "
            "a mean, and backward() adds them up.",
            f"{len(undivided)} optimizer steps each took {k} backward passes of an undivided mean loss "
            f"({undivided[0][0]['root']})", f"backward on loss / {k} (the number of micro-batches)"))
    if rec.get("ddp"):
        t0 = rec.get("t0_ns", 0)
        reduces = [(e["time_created_ns"] - t0) / 1e9 for e in rec.get("fr", [])
                   if (e.get("profiling_name") or "").endswith("all_reduce") and e.get("time_created_ns")]
        windows = list(zip(rec["backward"], rec.get("losses", [])))
        synced = [(w, loss["step"]) for w, loss in windows if loss["step"] in multi and
                  any(w[0] <= t <= w[1] for t in reduces)]
        per_step = {s: sum(1 for _, step in synced if step == s) for s in multi}
        if per_step and min(per_step.values()) == k:
            facts.add(Finding(
                "accum-sync", f"DDP all-reduces the gradients after every micro-batch, {k} times per optimizer step "
                "instead of once.", f"every one of the {k} backward passes per step was followed by DDP's "
                "all-reduce (flight recorder)", "run all but the last micro-batch inside `with model.no_sync():` "
                "(or set model.require_backward_grad_sync = False for them)", kind=COST))


def ddp_settings(records: dict, facts) -> None:
    rec = records[min(records)]
    unused = any(d["find_unused_parameters"] for d in rec.get("ddp", []))
    grads = rec.get("grads", [])
    if unused and grads and all(fp is not None for g in grads for fp in g["fp"]):
        facts.add(Finding(
            "find-unused", "find_unused_parameters=True, but every parameter got a gradient at every step: DDP "
            "searches the graph after each forward for nothing.",
            f"{len(grads)} optimizer steps, no parameter without a gradient",
            "drop find_unused_parameters=True (it is for models that skip parameters in some steps)", kind=COST))


def eval_through_ddp(records: dict, facts) -> None:
    """Forwards without gradients through the DDP wrapper that broadcast its buffers (BatchNorm's running
    statistics; only the first forward after a training forward does) on some ranks only: a collective the other
    ranks never join."""
    counts = {r: [e for e in rec.get("ddp_eval", []) if e["buffers"]] for r, rec in sorted(records.items())}
    if not any(counts.values()):
        return
    if len({len(v) for v in counts.values()}) == 1:
        facts.checked.append("evaluation through DDP (every rank broadcast the buffers as often)")
        return
    who = [r for r, v in counts.items() if v]
    facts.add(Finding(
        "eval-ddp-buffers", f"Rank {', '.join(map(str, who))} evaluates through the DDP wrapper alone. The first "
        "forward through the wrapper after a training forward broadcasts the model's buffers (BatchNorm's running "
        "statistics), once per evaluation: a collective the other ranks do not join there. It pairs with their "
        "next collective, and the job fails or hangs.",
        "; ".join(f"rank {r}: {len(v)} buffer broadcast(s) from forwards without gradients through "
                  "DistributedDataParallel"
                  + (f" (first at {v[0]['where']})" if v and v[0].get("where") else "")
                  + (f", each of {v[0]['buffers']} buffer(s)" if v else "") for r, v in counts.items()),
        "evaluate through the inner model on that rank (model.module(x)), or on every rank; or build DDP with "
        "forward_sync_buffers=False (torch 2.13 and later; broadcast_buffers=False before)"))
