# Written by notebooks/09_build_it_yourself.ipynb - edit it there; running the notebook rewrites this file.
# ruff: noqa: F401, F841, PIE790 - a stub: some imports and names are used once you fill it in
"""Exercise 3: a distributed sampler by hand.

ShardSampler gives each of num_replicas ranks its own share of the indices 0..len(dataset)-1, exactly as
torch's DistributedSampler does:
- shuffle (if shuffle) with a generator seeded with seed + epoch: the same permutation on every rank,
  a new one each epoch (set_epoch);
- without drop_last, pad to a multiple of num_replicas by repeating indices from the start, so that every
  rank gets the same number; with drop_last, cut the tail instead;
- rank r takes every num_replicas-th index, starting at r.
Fill in the gaps marked `...  # TODO`; the check compares your indices with DistributedSampler's.
"""
import math

import torch
from torch.utils.data import Sampler


class ShardSampler(Sampler[int]):
    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n = len(dataset)
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = ...  # TODO (a): how many indices each rank yields

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        indices = ...  # TODO (b): a list of every index 0..n-1, shuffled with seed + epoch if self.shuffle
        ...  # TODO (c): pad (drop_last=False) or cut (drop_last=True) to num_samples * num_replicas indices
        return iter(...)  # TODO (d): this rank's share
