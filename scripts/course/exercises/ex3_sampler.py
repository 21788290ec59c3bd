"""Exercise 3: a DistributedSampler by hand (checked in this process: no processes needed).

The check imports the learner's ShardSampler and compares, for every rank, its indices with torch's
DistributedSampler's: data sets from 1 to 16 samples (some smaller than the number of ranks, so that the
padding repeats the list more than once), 1 to 4 ranks, epochs 0-2, two seeds (one not the default),
shuffle and drop_last on and off. It also requires the order to be repeatable within an epoch and the
global random generators (torch's, Python's) to be left as they were: a sampler that reseeds them makes
every rank draw the same augmentation.
"""

import random
import re
import runpy
from itertools import islice
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from course.exercises.reference import seeded
from course.exercises.results import Exercise, Verdict, fail
from course.exercises.running import guarded

SIZES = (16, 11, 13, 10, 3, 2, 1)
WORLDS = (2, 3, 4, 1)
SEEDS = (0, 7)


def _watching_rngs(path: Path, sampler, epoch: int) -> tuple[list, list[str]]:
    """Iterate the sampler once more: its indices, and which global generators (torch's, Python's) it changed."""
    torch.manual_seed(1234 + epoch)
    random.seed(1234 + epoch)
    before = torch.get_rng_state(), random.getstate()
    got = guarded(path, lambda: list(islice(iter(sampler), 10_000)), "iterating")
    after = torch.get_rng_state(), random.getstate()
    changed = [name for name, a, b in zip(("torch's", "Python's"), before, after)
               if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)]
    return got, changed


def _contiguous(got: list[list], theirs: list, epoch: int) -> bool:
    """Whether every rank holds a contiguous block of DistributedSampler's padded list (the shape of the shards,
    not their order within it): rank r positions r*len to (r+1)*len instead of every num_replicas-th."""
    for t in theirs:
        t.set_epoch(epoch)
    want = [list(t) for t in theirs]
    padded = [w[i] for i in range(len(want[0])) for w in want]  # DistributedSampler's list, rank r at i*world + r
    size = len(want[0])
    blocks = [padded[r * size:(r + 1) * size] for r in range(len(want))]
    return len(want) > 1 and size > 1 and blocks != want and all(sorted(g) == sorted(b) for g, b in zip(got, blocks))


@seeded  # it seeds torch's global generator to see whether the sampler changes it
def check(path: Path, work: Path, *, backend: str = "gloo", timeout: float = 0) -> Verdict:
    text = path.read_text()
    if re.search(r"\bDistributedSampler\b", text.split('"""', 2)[-1]):
        fail("uses-torch", "the script uses torch's DistributedSampler: write the logic yourself (the check "
              "compares against it, so using it proves nothing).")
    namespace = guarded(path, lambda: runpy.run_path(str(path)), "loading the script")
    cls = namespace.get("ShardSampler")
    if cls is None:
        fail("no-class", "the script defines no class ShardSampler.")

    def indices(s):
        return list(islice(iter(s), 10_000))

    cases = [(n, w, dl, seed) for n in SIZES for w in WORLDS for dl in (False, True) for seed in SEEDS]
    checked = 0
    for shuffle in (True, False):
        for n, w, drop_last, seed in cases:
            dataset = list(range(n))
            where = f"n={n}, {w} rank(s), drop_last={drop_last}, shuffle={shuffle}, seed={seed}"
            def make(r, n=n, w=w, shuffle=shuffle, seed=seed, drop_last=drop_last):
                return cls(list(range(n)), num_replicas=w, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)

            mine = [guarded(path, lambda r=r: make(r), "ShardSampler(...)") for r in range(w)]
            theirs = [DistributedSampler(dataset, num_replicas=w, rank=r, shuffle=shuffle, seed=seed,
                                         drop_last=drop_last) for r in range(w)]
            by_epoch = []
            for epoch in (0, 1, 2):
                for s, t in zip(mine, theirs):
                    guarded(path, lambda s=s, e=epoch: s.set_epoch(e), "set_epoch()")
                    t.set_epoch(epoch)
                got = [guarded(path, lambda s=s: indices(s), "iterating") for s in mine]
                want = [list(t) for t in theirs]
                by_epoch.append(got)
                for r, (s, g, t, wnt) in enumerate(zip(mine, got, theirs, want)):
                    length = guarded(path, lambda s=s: len(s), "len()")
                    if length != len(t):
                        fail("length", f"{where}: len() of rank {r}'s sampler is {length}, DistributedSampler's is "
                              f"{len(t)}.")
                    if len(g) != len(wnt):
                        fail("count", f"{where}, epoch {epoch}: rank {r} yields {len(g)} indices, it should yield "
                              f"{len(wnt)} (= len()); ranks yield {[len(x) for x in got]}.")
                    if any(not isinstance(i, int) or not 0 <= i < n for i in g):
                        bad = next(i for i in g if not isinstance(i, int) or not 0 <= i < n)
                        fail("bad-index", f"{where}: rank {r} yields {bad!r}, not an index 0..{n - 1} (an int).")
                watched = [_watching_rngs(path, s, epoch) for s in mine]
                if [seen for seen, _ in watched] != got:
                    fail("not-repeatable", f"{where}, epoch {epoch}: iterating twice in the same epoch gives two "
                         "different orders: the shuffle does not come from the seed and the epoch alone.")
                changed = next((c for _, c in watched if c), None)
                if changed:
                    fail("global-rng", f"{where}, epoch {epoch}: iterating the sampler changed {' and '.join(changed)} "
                         "global random generator: every rank draws the same random numbers after it (the same "
                         "augmentation).")
                flat = [i for g in got for i in g]
                if n % w == 0 and len(flat) == n and len(set(flat)) < n:
                    dup = next(i for i in flat if flat.count(i) > 1)
                    owners = [r for r, g in enumerate(got) if dup in g]
                    fail("overlap", f"{where}, epoch {epoch}: the shards overlap — index {dup} is given to "
                          + (f"ranks {owners[0]} and {owners[1]}" if len(owners) > 1 else f"rank {owners[0]} twice")
                          + f", while {sorted(set(range(n)) - set(flat))[:3]} go to nobody.")
            if shuffle and n > 3 and by_epoch[0] == by_epoch[1]:
                fail("same-every-epoch", f"{where}: epochs 0 and 1 give every rank the same indices in the "
                      f"same order (rank 0: {by_epoch[0][0][:6]}...), although set_epoch was called.")
            for epoch, got in enumerate(by_epoch):
                for r, t in enumerate(theirs):
                    t.set_epoch(epoch)
                    want = list(t)
                    if got[r] != want:
                        if _contiguous(got, theirs, epoch):
                            length = len(want)
                            fail("contiguous", f"{where}, epoch {epoch}: rank {r} yields {got[r][:8]}"
                                 f"{'...' if length > 8 else ''}: each rank holds one contiguous block of "
                                 f"{length} of the padded list (rank r: positions r*{length} to (r+1)*{length}), "
                                 "DistributedSampler gives rank r every num_replicas-th position, starting at r.")
                        same_set = sorted(got[r]) == sorted(want)
                        fail("order" if same_set else "indices",
                              f"{where}, epoch {epoch}: rank {r} yields {got[r][:8]}{'...' if len(got[r]) > 8 else ''},"
                              f" DistributedSampler yields {want[:8]}{'...' if len(want) > 8 else ''}"
                              + (" — the same indices in another order." if same_set else "."))
            checked += 1
    return Verdict("pass", "pass", f"{checked} cases (dataset sizes {', '.join(map(str, SIZES))}; "
                   f"{', '.join(map(str, WORLDS))} ranks; drop_last and shuffle on and off; seeds "
                   f"{' and '.join(map(str, SEEDS))}; epochs 0-2, every rank): the same indices as "
                   "DistributedSampler, in the same order, and the global random generators left as they were.")


HINTS = {
    "length": ["len() must say how many indices each rank yields: the same number on every rank.",
               "Without drop_last, round up (pad); with drop_last, round down (cut). Try n=11 with 3 ranks on paper.",
               "num_samples = ceil(n / num_replicas) without drop_last, floor(n / num_replicas) with it."],
    "count": ["Every rank must yield exactly len() indices, even when the data set does not split evenly.",
              "How many indices do you need in all before splitting? num_samples × num_replicas.",
              ("Without drop_last, append indices from the start of the list until it is long enough: when the data "
               "set is smaller than the padding (n=1 with 4 ranks), the list must be repeated more than once; with "
               "drop_last, cut the list to that length.")],
    "global-rng": [("Your sampler changes the global random generator (torch's or Python's): every rank then draws "
                    "the same random numbers after it, for example the same data augmentation."),
                   ("Compare torch.get_rng_state() before and after iterating your sampler: they must be equal. "
                    "Which call seeds or draws from the global generator?"),
                   ("Use a generator of your own: g = torch.Generator(); g.manual_seed(self.seed + self.epoch); "
                    "torch.randperm(self.n, generator=g) (never torch.manual_seed in a sampler).")],
    "bad-index": ["Yield plain int indices between 0 and n-1 (call .tolist() on a tensor)."],
    "overlap": ["Two ranks got the same index while others went to nobody: the shards overlap.",
                ("Print each rank's list for n=8 and 2 ranks: together they must be a permutation of range(8). Does "
                 "every rank compute the same permutation?"),
                ("Every rank must shuffle with the same generator seed (seed + epoch, never the rank), then take "
                 "indices[rank::num_replicas].")],
    "not-repeatable": [("The order must depend only on seed and epoch (every rank computes it on its own and they "
                        "must agree)."),
                       ("Does your shuffle use the global random generator (torch.randperm without generator=, "
                        "random.shuffle)?"),
                       "Create a torch.Generator, manual_seed(self.seed + self.epoch), and pass it to torch.randperm."],
    "same-every-epoch": ["set_epoch was called, but the order did not change.",
                         "What does set_epoch store, and does __iter__ use it?",
                         "Seed the generator with self.seed + self.epoch."],
    "order": ["Your shard holds the right indices in another order.",
              ("DistributedSampler shuffles with torch.randperm(n, generator=g), g seeded with seed + epoch; "
               "then it takes every num_replicas-th index."),
              ("Use exactly: g = torch.Generator(); g.manual_seed(self.seed + self.epoch); "
               "torch.randperm(self.n, generator=g).tolist(); then indices[self.rank::self.num_replicas].")],
    "contiguous": [("Each rank holds one contiguous block of the list: DistributedSampler interleaves the shards "
                    "instead (rank r takes positions r, r + num_replicas, r + 2 num_replicas, ...)."),
                   ("Print both for n=8 and 2 ranks: a block gives rank 0 positions 0-3, DistributedSampler "
                    "positions 0, 2, 4, 6. Interleaving keeps each rank's share spread over the whole shuffled list."),
                   "Take this rank's share with a stride: indices[self.rank::self.num_replicas]."],
    "indices": ["Your shard holds other indices than DistributedSampler's.",
                ("Which positions of the padded list does rank r take? DistributedSampler takes every "
                 "num_replicas-th, starting at r (not a contiguous block); padding repeats the list from its start."),
                "indices += indices[:padding] (repeat if needed), then indices[self.rank::self.num_replicas]."],
    "uses-torch": ["Write the sampler yourself, from torch.randperm and list slicing."],
    "no-class": ["Keep the class name ShardSampler: the check looks for it."],
}



EXERCISES = [Exercise("3", "A DistributedSampler by hand", "ex3_sampler.py", check, HINTS, launches=False)]
