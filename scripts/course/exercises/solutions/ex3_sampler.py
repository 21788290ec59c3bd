# Reference solution of exercise 3 of notebooks/09_build_it_yourself.ipynb: look after you have tried.
"""Exercise 3: a distributed sampler by hand.

ShardSampler gives each of num_replicas ranks its own share of the indices 0..len(dataset)-1, exactly as
torch's DistributedSampler does:
- shuffle (if shuffle) with a generator seeded with seed + epoch: the same permutation on every rank,
  a new one each epoch (set_epoch);
- without drop_last, pad to a multiple of num_replicas by repeating indices from the start, so that every
  rank gets the same number; with drop_last, cut the tail instead;
- rank r takes every num_replicas-th index, starting at r.
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
        # (a) how many indices each rank yields: round up (pad) without drop_last, down (cut) with it
        self.num_samples = self.n // num_replicas if drop_last else math.ceil(self.n / num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        # (b) every rank computes the same permutation: it depends on seed and epoch only
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.n, generator=g).tolist()
        else:
            indices = list(range(self.n))
        # (c) exactly num_samples for every rank: repeat from the start (as often as needed), or cut
        total = self.num_samples * self.num_replicas
        while len(indices) < total:
            indices += indices[:total - len(indices)]
        indices = indices[:total]
        # (d) this rank's share: every num_replicas-th index, starting at its rank
        return iter(indices[self.rank::self.num_replicas])
