"""Exercise 3 (a DistributedSampler by hand), checked in this process: the solution and a differently
written correct sampler pass; each realistic mistake fails with its own diagnosis, including padding that
must repeat a data set smaller than the number of ranks and a sampler that reseeds the global generator."""

import pytest
from exercise_helpers import mutate, run_check_fixture  # noqa: F401 - the run_check fixture

from course.exercises import EXERCISES

SHUFFLE = ("            g = torch.Generator()\n            g.manual_seed(self.seed + self.epoch)\n"
           "            indices = torch.randperm(self.n, generator=g).tolist()\n")

SAMPLER_MISTAKES = {
    "overlap": [("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed + self.epoch + self.rank)")],
    "same-every-epoch": [("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)")],
    "not-repeatable": [("torch.randperm(self.n, generator=g)", "torch.randperm(self.n)")],
    "count": [("        while len(indices) < total:\n            indices += indices[:total - len(indices)]\n", "")],
    "length": [("self.n // num_replicas if drop_last else math.ceil(self.n / num_replicas)",
                "math.ceil(self.n / num_replicas)")],
    "indices": [("return iter(indices[self.rank::self.num_replicas])",
                 "return iter(indices[self.rank * self.num_samples:(self.rank + 1) * self.num_samples])")],
    "crash": [("indices = list(range(self.n))", "indices = list(range(self.size))")],
    # padding only once: right whenever the data set is at least as large as the padding, wrong for n=1, 3 ranks
    "count ": [("        while len(indices) < total:\n", "        if len(indices) < total:\n")],
    # the same permutation as DistributedSampler's, but every rank then draws the same augmentation
    "global-rng": [(SHUFFLE, ("            torch.manual_seed(self.seed + self.epoch)\n"
                             "            indices = torch.randperm(self.n).tolist()\n"))],
}

ANOTHER_CORRECT_SAMPLER = '''
import math

import torch
from torch.utils.data import Sampler


class ShardSampler(Sampler[int]):
    """Written differently from the solution: tensors throughout, padding by tiling, a generator per call."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.size, self.replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return (self.size // self.replicas) if self.drop_last else -(-self.size // self.replicas)

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        total = len(self) * self.replicas
        order = order.repeat(math.ceil(total / self.size))[:total]
        yield from order[self.rank::self.replicas].tolist()
'''


def test_sampler_solution_passes(run_check):
    result = run_check("3", path=EXERCISES["3"].solution)
    assert result.passed, result.symptom
    assert "224 cases" in result.symptom and "sizes 16, 11, 13, 10, 3, 2, 1" in result.symptom


def test_a_differently_written_correct_sampler_passes(run_check):
    result = run_check("3", ANOTHER_CORRECT_SAMPLER)
    assert result.passed, result.symptom


@pytest.mark.parametrize("name", SAMPLER_MISTAKES)
def test_sampler_mistake_gets_its_hint(name, run_check):
    result = run_check("3", mutate("3", *SAMPLER_MISTAKES[name]))
    assert result.diagnosis == name.strip(), result.symptom
    assert not result.passed
    assert result.hint == EXERCISES["3"].hints_for(result.diagnosis)[0]
    if name == "crash":
        assert "AttributeError" in result.symptom and "line" in result.symptom
    if name == "count ":
        assert "n=1, 3 rank(s)" in result.symptom, "only a data set smaller than the padding shows it"
    if name == "global-rng":
        assert "torch's" in result.symptom


def test_sampler_that_never_returns_is_interrupted(run_check, monkeypatch):
    from course.exercises import running

    monkeypatch.setattr(running, "CALL_LIMIT_S", 2)  # the limit is read at each call; 10 s in the course
    text = mutate("3", ("        return iter(indices[self.rank::self.num_replicas])",
                        "        while True:\n            pass"))
    result = run_check("3", text)
    assert (result.status, result.diagnosis) == ("error", "hang") and "did not return within 2 s" in result.symptom
    assert result.seconds < 12
