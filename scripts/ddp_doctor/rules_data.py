"""The doctor's rules about data, each made from what the run did (``recorder_training``'s record of every pass
over a DataLoader, every training forward's input): the data split between the ranks, its order from epoch to
epoch, evaluation, batches per rank, threads against cores (files: ``rules_files``).

Each rule takes the records (rank -> record) and the ``Facts`` being built, and adds findings, what it checked
and what it could not check."""

import itertools
import re
from collections import Counter

from ddp_doctor.report import COST, Finding

SHUFFLED = ("DistributedSampler", "RandomSampler")
RECORDED_STEPS = 40  # the recorder fingerprints the first 40 optimizer steps (recorder_training.MAX_STEPS)


def _first(indices, n=5) -> str:
    return ", ".join(map(str, indices[:n])) + (" ..." if len(indices) > n else "")


def passes(rec: dict, train: bool) -> list:
    """A rank's training (or evaluation) passes over its DataLoaders, in order. A peek at one batch of several
    (``_peek``) has no optimizer step in it, and is no evaluation either."""
    stepped = _stepped(rec)
    return [p for p in rec.get("loaders", []) if (p["train"] and id(p) in stepped) == train
            and (train or not _peek(p))]


def _stepped(rec: dict) -> set:
    """ids of the passes that trained: gradients on at their start and an optimizer step between their start and
    their end (or the next pass of their loader). A pass with gradients on but no step in it evaluated: a script
    may turn gradients off inside its batch function, not around the loop. Where no step was recorded in any such
    pass (none at all, or accumulation longer than the passes), gradients on is enough."""
    on = [p for p in rec.get("loaders", []) if p["train"]]
    steps = [g["t"] for g in rec.get("grads", [])]

    def end(p):
        later = (q["t"] for q in rec["loaders"] if q["loader"] == p["loader"] and q["t"] > p["t"])
        return p.get("end") or next(later, float("inf"))

    stepped = {id(p) for p in on if any(p["t"] <= t <= end(p) for t in steps)
               or p.get("step", 0) >= len(steps) >= RECORDED_STEPS}  # past the recorded steps: unknown, as before
    return stepped or {id(p) for p in on}


def by_loader(rec: dict, train: bool) -> list:
    """A rank's passes grouped by DataLoader, loaders in the order they were first used."""
    groups: dict = {}
    for p in passes(rec, train):
        groups.setdefault(p["loader"], []).append(p)
    return list(groups.values())


def _local_rank_hint(records) -> str:
    if len(records) > 1 and all((r["env"].get("LOCAL_RANK") or "0") == "0" for r in records.values()):
        return (" (this run had one process per simulated node, so LOCAL_RANK was 0 on every rank: if the script "
                "tests LOCAL_RANK where it means the global rank, use RANK)")
    return ""


def sharding(records: dict, facts) -> None:
    """The ranks' training samples: split between them (no overlap, nothing left out) or not."""
    ranks = sorted(records)
    first = [passes(records[r], True) for r in ranks]
    if not all(first):
        _inputs(records, facts)
        return
    a = [f[0] for f in first]  # the first training pass of every rank
    size = a[0]["size"]
    facts.checked.append(f"data split ({a[0]['count']} samples per rank and pass, dataset of {size})")
    views = {p.get("view") for p in a}
    if len(views) > 1 and None not in views:  # each rank's dataset holds index lists of its own: a partition
        _by_samples(a, facts)
        return
    shared = set(a[0]["indices"]).intersection(*(set(p["indices"]) for p in a[1:]))
    whole = all(p["count"] + p["count"] // max(p["batches"], 1) >= p["size"] for p in a)  # drop_last: a batch less
    if size and whole and len(shared) * 2 >= a[0]["count"] and not _per_rank(records, a, sorted(shared), facts):
        same = all(p["indices"] == a[0]["indices"] for p in a)
        facts.add(Finding(
            "not-sharded", "The ranks' training data is not split: every rank goes through the whole dataset"
            + (" in the same order (identical batches)." if same else ", each in its own order."),
            f"the {a[0]['sampler']} of each of the {len(ranks)} ranks yields all {size} samples per pass"
            + (f"; both start with samples {_first(a[0]['indices'])}" if same else ""),
            "give the DataLoader `sampler=DistributedSampler(dataset)` (and shuffle=False on the DataLoader), "
            "so that each rank takes 1/world_size of the samples, and call `sampler.set_epoch(epoch)` at the start "
            "of every epoch, so that the shuffle changes from epoch to epoch"))
        return
    counts = Counter(i for p in a for i in set(p["indices"]))
    twice = sorted(i for i, c in counts.items() if c > 1)
    if twice and _per_rank(records, a, twice, facts):
        return
    if twice and not _padded(a, len(counts), len(ranks)):
        facts.add(Finding(
            "shard-overlap", "The ranks' training samples overlap: several ranks train on the same samples.",
            f"{len(twice)} samples are in the shards of two or more ranks in the first pass (e.g. {_first(twice)})"
            + (f"; sampler rank/num_replicas: {[(p['distributed'] or {}).get('rank') for p in a]}/"
               f"{a[0]['distributed'].get('num_replicas')}" if a[0]["distributed"] else ""),
            "create DistributedSampler(dataset) without rank= or num_replicas= (it reads them from the process "
            "group), or pass dist.get_rank() and dist.get_world_size()" + _local_rank_hint(records)))
    elif a[0]["distributed"] and a[0]["distributed"]["num_replicas"] > len(ranks):
        facts.add(Finding(
            "shard-gap", "The ranks' shards leave samples out: the sampler splits the data for more ranks than run.",
            f"DistributedSampler(num_replicas={a[0]['distributed']['num_replicas']}) on {len(ranks)} ranks: "
            f"{sum(p['count'] for p in a)} of {size} samples per pass are used",
            "let DistributedSampler take num_replicas and rank from the process group"))


def _by_samples(a: list, facts) -> None:
    """Ranks whose datasets hold different index lists (a hand-made partitioner's): their samplers' indices mean
    different samples, so the split is judged by the samples each drew (fingerprints of their inputs)."""
    drawn = [set(p.get("samples", [])) for p in a]
    if not all(drawn):
        facts.unchecked.append("the data split: each rank's dataset holds index lists of its own, and the samples "
                               "drawn were not recorded (no tensor in the batches)")
        return
    counts = Counter(s for d in drawn for s in d)
    twice = sum(c > 1 for c in counts.values())
    facts.checked[-1] = facts.checked[-1][:-1] + (f"; each rank's dataset holds index lists of its own: of the "
                                                  f"{len(counts)} samples the ranks drew first, {twice} by two ranks "
                                                  "or more)")
    if twice * 20 >= len(counts):
        facts.add(Finding(
            "shard-overlap", "The ranks' training samples overlap: several ranks train on the same samples.",
            f"each rank's dataset holds index lists of its own, yet {twice} of the {len(counts)} samples the ranks "
            "drew first were drawn by two ranks or more", "cut one shuffle into parts, the same on every rank (one "
            "seed), and give each rank the part dist.get_rank(); or use DistributedSampler(dataset) on the whole "
            "dataset"))


def _padded(a: list, covered: int, n: int) -> bool:
    """Shards of equal length that cover the whole dataset, with fewer repeats than ranks: the padding that
    DistributedSampler (or a sampler that pads as it does) adds so that every rank gets as many samples."""
    repeats = sum(len(p["indices"]) for p in a) - covered
    return covered == a[0]["size"] and len({len(p["indices"]) for p in a}) == 1 and 0 < repeats < n


def _per_rank(records: dict, a: list, shared: list, facts) -> bool:
    """Shared samples whose cause is that each rank made its own split (a random Subset drawn on every rank) or
    its own data (drawn at random on every rank): named as such (True), not as a sampler's arguments."""
    if len({p.get("split") for p in a}) > 1:
        ranks = sorted(records)
        train = {r: set(p["indices"]) for r, p in zip(ranks, a)}
        leaks = [(r, s, len(set(q["indices"]) & train[s])) for r in ranks for s in ranks if s != r
                 for q in passes(records[r], False)[:1]]
        leak = max(leaks, key=lambda item: item[2], default=(0, 0, 0))
        facts.add(Finding(
            "split-per-rank", "Each rank splits the dataset its own way (a random split drawn on every rank): the "
            "ranks' training sets overlap, and one rank's validation samples are another rank's training samples.",
            f"the ranks' Subsets of the {a[0]['dataset']} differ; {len(shared)} training samples are in the shards "
            f"of two or more ranks (e.g. {_first(shared)})"
            + (f"; {leak[2]} of rank {leak[0]}'s validation samples are in rank {leak[1]}'s training set"
               if leak[2] else ""),
            "draw the split once, the same on every rank: random_split(..., generator=torch.Generator()."
            "manual_seed(0)) with a seed that does not depend on the rank, then DistributedSampler(train_set)"))
        return True
    data = {tuple(p["data"]) if p.get("data") else None for p in a}
    if len(data) > 1 and None not in data:
        facts.add(Finding(
            "split-per-rank", "Each rank draws its own data (at random, with no seed the ranks share): they do not "
            "split one dataset, so a sample's index names a different sample on each rank.",
            f"the ranks' {a[0]['dataset']} hold different tensors (sums "
            + ", ".join(f"{d[0]:.4g}" for d in sorted(data)) + f"); their samplers share {len(shared)} indices",
            "make the data the same on every rank (one seed for all ranks, or read it from a file), then let "
            "DistributedSampler(dataset) split it"))
        return True
    return False


def _inputs(records: dict, facts) -> None:
    """No DataLoader pass recorded: compare the inputs of the ranks' training forwards instead."""
    fps = [[f["x"] for f in records[r].get("forwards", [])] for r in sorted(records)]
    n = min(map(len, fps)) if fps else 0
    if n == 0:
        facts.unchecked.append("data split (no training forward recorded)")
        return
    same = sum(all(f[k] is not None and f[k] == fps[0][k] for f in fps) for k in range(n))
    facts.checked.append(f"data split ({n} training inputs per rank compared; no DataLoader pass recorded)")
    if same >= max(2, n // 2) and not facts.model_parallel:
        facts.add(Finding(
            "not-sharded", "The ranks train on identical inputs.",
            f"{same} of the first {n} training forwards got the same input on every rank",
            "give each rank its own part of the data (DistributedSampler, or a seed/offset that depends on the "
            "rank)"))


def _peek(p: dict) -> bool:
    """A pass that read one batch of several (``next(iter(loader))`` to see a batch's size, as the DDP tutorial
    series' ``_run_epoch`` does before ``set_epoch``): not an epoch."""
    return "consumed" in p and p["consumed"] <= 1 < min(p["batches"], p.get("cut") or p["batches"])


def epoch_order(records: dict, facts) -> None:
    """A shuffled sampler must give each epoch a new order (DistributedSampler: set_epoch before the loop)."""
    checked = False
    for r in sorted(records):
        for group in ([p for p in g if not _peek(p)] for g in by_loader(records[r], True)):
            if len(group) < 2 or group[0]["sampler"] not in SHUFFLED:
                continue
            if group[0]["distributed"] and not group[0]["distributed"]["shuffle"]:
                continue
            checked = True
            for prev, cur in itertools.pairwise(group):
                if prev["indices"] and prev["indices"] == cur["indices"]:
                    epochs = [p["distributed"]["epoch"] for p in (prev, cur)] if prev["distributed"] else None
                    facts.add(Finding(
                        "set-epoch", "The training data comes in the same order every epoch.",
                        f"rank {r}'s {prev['sampler']} gave two passes in a row the same order (first samples "
                        f"{_first(cur['indices'])})"
                        + (f"; its epoch was {epochs[0]} both times" if epochs and epochs[0] == epochs[1] else ""),
                        "call sampler.set_epoch(epoch) at the start of every epoch, before the loop over the "
                        "DataLoader" if prev["distributed"] else "seed the sampler's generator with the epoch"))
                    return
    if checked:
        facts.checked.append("sample order from epoch to epoch")
    elif any(len(g) == 1 for r in records.values() for g in by_loader(r, True)):
        facts.unchecked.append("the order from epoch to epoch (one pass per DataLoader: run 2 epochs or more)")


def uneven(records: dict, facts) -> None:
    """Different numbers of training batches per rank: the rank with more waits for the others at its last ones."""
    lengths = {r: [p["batches"] for p in passes(rec, True)][:1] for r, rec in records.items()}
    if not all(lengths.values()):
        return
    facts.checked.append("batches per rank and pass")
    counts = {r: v[0] for r, v in lengths.items()}
    if len(set(counts.values())) > 1 and not any(rec.get("join") for rec in records.values()):
        facts.add(Finding(
            "uneven-batches", "The ranks have different numbers of training batches per epoch: at the end, the "
            "ranks with more wait in DDP's all-reduce until the process-group timeout ends the job.",
            ", ".join(f"rank {r}: {n} batches" for r, n in sorted(counts.items())),
            "make the shards equal (DistributedSampler pads them; or drop_last=True), or wrap the loop in "
            "`with Join([model]):`"))


def _collective_after(rec: dict, start: float, end: float | None) -> bool:
    t0 = rec.get("t0_ns", 0)
    times = [c["t"] for c in rec.get("collectives", []) if c["op"] not in ("barrier", "monitored_barrier")]
    times += [(e["time_created_ns"] - t0) / 1e9 for e in rec.get("fr", []) if e.get("time_created_ns")
              and "barrier" not in (e.get("profiling_name") or "")]
    return any(t >= start and (end is None or t <= end) for t in times)


def evaluation(records: dict, facts) -> None:
    """Evaluation passes: the sampler's padding counted, or only one rank's shard evaluated."""
    evals = {r: passes(rec, False) for r, rec in records.items()}
    if not any(evals.values()):
        facts.unchecked.append("evaluation (no DataLoader pass without gradients recorded)")
        return
    facts.checked.append("evaluation passes")
    ranks = sorted(records)
    first = {r: evals[r][0] for r in ranks if evals[r]}
    one = next(iter(first.values()))
    size, count = one["base"], one["count"]  # the whole validation set, and what one rank evaluated
    if len(first) < len(ranks) and size and count < size:
        who = ", ".join(f"rank {r}" for r in first)
        facts.add(Finding(
            "eval-one-shard", f"Only {who} evaluated, on its own shard: the result describes part of the "
            "validation set.", f"{who} evaluated {count} of {size} samples; the other ranks evaluated none",
            "let every rank evaluate its shard and all_reduce [correct, total] (or evaluate the whole set on "
            "rank 0 without a DistributedSampler)"))
        return
    dist = one["distributed"]
    if dist and not dist["drop_last"] and dist["total_size"] > one["size"] and len(first) == len(ranks):
        seen = Counter(i for p in first.values() for i in p["indices"])
        twice = sorted(i for i, c in seen.items() if c > 1)
        facts.add(Finding(
            "eval-padding", "Evaluation counts samples twice: the DistributedSampler pads the validation set so that "
            "every rank gets as many samples.",
            f"{one['size']} validation samples padded to {dist['total_size']}; evaluated on two ranks: sample(s) "
            f"{_first(twice)}",
            "split validation without padding (Subset(val_set, range(rank, len(val_set), world_size))) and "
            "all_reduce the counts"))
    elif size and all(p["count"] < size for p in first.values()) and len(first) > 1:
        combined = all(_collective_after(records[r], p["t"], _next_start(records[r], p)) for r, p in first.items())
        if not combined:
            facts.add(Finding(
                "eval-one-shard", "Each rank evaluates its own shard and nothing combines the results: the "
                "reported figure is one rank's share.",
                f"rank 0's evaluation pass covers {first[ranks[0]]['count']} of {size} samples, and no collective followed before "
                "the next training step", "all_reduce [correct, total] (or the summed loss and count) after the "
                "evaluation loop, on every rank"))


def _next_start(rec: dict, p: dict) -> float | None:
    later = [q["t"] for q in passes(rec, True) if q["t"] > p["t"]]
    return min(later) if later else None


def oversubscribed(records: dict, facts) -> None:
    """CPU ranks: threads x processes + DataLoader workers against the cores."""
    rec = records[min(records)]
    threads, cpus = rec.get("threads", {}).get("torch", 1), rec.get("threads", {}).get("cpus") or 1
    local = len(records)  # the doctor's simulated nodes all run on this machine
    if not rec.get("modules") or rec["modules"][0]["device"] != "cpu":
        return
    workers = max((p["workers"] for p in rec.get("loaders", [])), default=0)
    if local * threads > cpus:  # DataLoader workers mostly wait: threads are what compete
        facts.add(Finding(
            "oversubscribed", "More compute threads than CPU cores: the ranks take turns and the run gets slower.",
            f"{local} process(es) x {threads} torch thread(s) = {local * threads} on {cpus} cores"
            + (f", plus {workers} DataLoader worker(s) each" if workers else ""),
            "give each rank cores // processes threads (torch.set_num_threads, or OMP_NUM_THREADS)", kind=COST))


DIVIDED = re.compile(r"/\s*\(?\s*len\(\s*([\w.]+)\s*\)")


def divisor_hint(records: dict, source: str) -> str:
    """An all-reduced count divided by one rank's share: the source divides by len(a sampler) where the run's
    evaluation split the set over the ranks and a collective followed. A hint: the run cannot see the division."""
    shares = [(p, rec) for rec in records.values() for p in passes(rec, False)[:1]
              if p["distributed"] and p["count"] < (p["base"] or 0)]
    if not shares or not all(_collective_after(rec, p["t"], _next_start(rec, p)) for p, rec in shares):
        return ""
    samplers = set(re.findall(r"([\w.]+)\s*=\s*(?:\w+\.)*DistributedSampler\(", source))
    names = [n for n in DIVIDED.findall(source) if n in samplers or "sampler" in n.lower()]
    if not names or "all_reduce" not in source:
        return ""
    p = shares[0][0]
    return (f"the script divides by len({names[0]}) after an all_reduce: that is one rank's share ({p['count']} of the "
            f"{p['base']} validation samples in this run), so a count summed over the ranks divided by it is "
            f"{p['distributed']['num_replicas']}x too large; divide by the all-reduced total (or len(dataset))")
