"""The test set of the deep-dive exercises of notebook 09 (3: a sampler, 4: overlap, 5: ZeRO-1): realistic mistakes
and correct alternatives, as edits of each reference solution or whole scripts (see ``course.exercises.mutations``)."""

from course.exercises.mutations import Case

# ------------------------------------------------------------------ exercise 3: a DistributedSampler by hand
SHUFFLE = ("            g = torch.Generator()\n            g.manual_seed(self.seed + self.epoch)\n"
           "            indices = torch.randperm(self.n, generator=g).tolist()\n")
ANOTHER_SAMPLER = '''
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

EX3 = [
    Case("3", "seeded with the rank", "overlap",
         (("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed + self.epoch + self.rank)"),)),
    Case("3", "seeded without the epoch", "same-every-epoch",
         (("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)"),)),
    Case("3", "no generator", "not-repeatable", (("torch.randperm(self.n, generator=g)", "torch.randperm(self.n)"),)),
    Case("3", "no padding", "count",
         (("        while len(indices) < total:\n            indices += indices[:total - len(indices)]\n", ""),)),
    Case("3", "padded only once", "count", (("        while len(indices) < total:\n", "        if len(indices) < total:\n"),)),
    Case("3", "length always rounded up", "length",
         (("self.n // num_replicas if drop_last else math.ceil(self.n / num_replicas)", "math.ceil(self.n / num_replicas)"),)),
    Case("3", "contiguous shares", "contiguous",
         (("return iter(indices[self.rank::self.num_replicas])",
           "return iter(indices[self.rank * self.num_samples:(self.rank + 1) * self.num_samples])"),)),
    Case("3", "a name that does not exist", "crash-name", (("indices = list(range(self.n))", "indices = list(range(self.size))"),)),
    Case("3", "the global generator reseeded", "global-rng",
         ((SHUFFLE, ("            torch.manual_seed(self.seed + self.epoch)\n"
                    "            indices = torch.randperm(self.n).tolist()\n")),)),
    Case("3", "written differently", "pass", text=ANOTHER_SAMPLER),
    Case("3", "padded by repeating the whole list", "pass",
         (("        while len(indices) < total:\n            indices += indices[:total - len(indices)]\n",
           "        indices = indices * math.ceil(total / max(len(indices), 1))\n"),), "false-fail"),
]

# ------------------------------------------------------------------ exercise 4: overlap, buckets and hooks
START = "            self.pending.append((dist.all_reduce(flat, async_op=True), flat, i))\n"
WAIT = "            handle.wait()\n"
DIVIDE = "            flat /= self.world_size\n"
HOOKS = "        for p in model.parameters():\n            p.register_post_accumulate_grad_hook"
EX4 = [
    Case("4", "one all_reduce per parameter", "per-parameter",
         (("self.buckets = make_buckets(model.parameters(), cap)",
           "self.buckets = [[p] for p in reversed(list(model.parameters()))]"),)),
    # waiting on the last handle only: right or wrong by luck on the numbers, always caught by the recorder
    Case("4", "only the last handle waited on", "not-waited",
         (("        for handle, flat, i in self.pending:\n" + WAIT,
           ("        self.pending[-1][0].wait()  # the last one done: so are the others?\n"
           "        for handle, flat, i in self.pending:\n")),), "race"),
    Case("4", "counts not reset", "not-reset", (("        self.pending, self.ready = [], [0] * len(self.buckets)\n", ""),)),
    Case("4", "all_reduce after backward()", "no-overlap",
         ((START, "            self.pending.append((None, None, i))\n"),
          ("        for handle, flat, i in self.pending:\n" + WAIT,
           ("        for _, _, i in self.pending:\n            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])\n"
           "            dist.all_reduce(flat)\n")))),
    Case("4", "a blocking all_reduce in the hook", "not-async",
         ((START, "            dist.all_reduce(flat)\n            self.pending.append((None, flat, i))\n"), (WAIT, ""))),
    Case("4", "each handle waited on at once", "waited-at-once",
         ((START, ("            handle = dist.all_reduce(flat, async_op=True)\n            handle.wait()  # done: go on\n"
                  "            self.pending.append((handle, flat, i))\n")),), "false-pass"),
    Case("4", "divided before wait()", "race", ((DIVIDE, ""), (START, START + "            flat /= self.world_size\n")),
         "race"),
    Case("4", "summed", "summed", ((DIVIDE, ""),), "averaged"),
    Case("4", "averaged, then divided again", "halved",
         (("dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True)"),),
         "averaged"),
    Case("4", "offsets not advanced", "differs", (("                offset += q.numel()\n", ""),)),
    Case("4", "one parameter without a hook", "collective-count", ((HOOKS, HOOKS.replace("model.parameters()",
                                                                                        "list(model.parameters())[1:]")),)),
    Case("4", "divided before the all-reduce", "pass",
         (("flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])",
           "flat = torch.cat([q.grad.flatten() for q in self.buckets[i]]) / self.world_size"), (DIVIDE, ""))),
    Case("4", "ReduceOp.AVG", "pass",
         (("dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True)"),
          (DIVIDE, ""))),
    Case("4", "futures", "pass", ((WAIT, "            handle.get_future().wait()\n"),)),
    # one bucket in flight at a time: each waited on when the next is ready, still overlapping backward()
    Case("4", "the previous bucket waited on in the hook", "pass",
         ((START, "            for handle, _, _ in self.pending[-1:]:\n                handle.wait()\n" + START),),
         "false-fail"),
]

# ------------------------------------------------------------------ exercise 5: ZeRO-1
ADAM = "torch.optim.Adam(mine, lr=args.lr)"
BROADCAST = "        for p in model.parameters():\n            dist.broadcast(p.data, src=owner[p])\n"
EX5 = [
    Case("5", "Adam over every parameter", "state-not-sharded", ((ADAM, "torch.optim.Adam(model.parameters(), lr=args.lr)"),)),
    Case("5", "no broadcast after the step", "ranks-differ", ((BROADCAST, ""),)),
    Case("5", "broadcast from rank 0", "not-updated", (("dist.broadcast(p.data, src=owner[p])", "dist.broadcast(p.data, src=0)"),)),
    Case("5", "broadcast before the step", "ranks-differ",
         (("        optimizer.step()  # updates this rank's parameters only\n", ""),
          (BROADCAST, BROADCAST + "        optimizer.step()\n"))),
    Case("5", "Adam's default learning rate", "lr", ((ADAM, "torch.optim.Adam(mine)"),), "own-hint"),
    Case("5", "parameters averaged instead of gradients", "params-averaged",
         (("        average_gradients(model, world_size)\n", ""),
          ("            dist.broadcast(p.data, src=owner[p])", ("            dist.all_reduce(p.data)\n"
                                                             "            p.data /= world_size"))), "own-hint"),
    Case("5", "only the owned gradients cleared", "later-step",
         (("model.zero_grad()  # every gradient", "optimizer.zero_grad()  # every gradient"),), "own-hint"),
    Case("5", "a typo", "crash-name", (("mine = [p for p in model.parameters() if owner[p] == rank]",
                                   "mine = [p for p in model.parameters() if owner[p] == rnak]"),)),
    Case("5", "ReduceOp.AVG", "pass",
         (("        dist.all_reduce(p.grad)\n        p.grad /= world_size\n",
           "        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n"),)),
    Case("5", "broadcasts asynchronous, waited on together", "pass",
         ((BROADCAST, ("        handles = [dist.broadcast(p.data, src=owner[p], async_op=True) for p in model.parameters()]\n"
                      "        for handle in handles:\n            handle.wait()\n")),)),
]

CASES = [*EX3, *EX4, *EX5]
