"""Issue 44's kinds of mistakes whose first hint rung was generic or misleading (group ``rungs``): the cases the
rules that name them were written for. The same kinds, written before those rules and never used to write
them, are the held-out set (``heldout.py``); the benchmark reports both apart. The tests check a few of these
(``TESTED_RUNGS``), the diagnosis → rung logic in this process on recorded results (tests/test_exercises_rungs.py).
"""

from course.exercises.mutations import Case

R = "rungs"
SUM = "        dist.all_reduce(p.grad)  # the sum over ranks (ReduceOp.SUM), in place, on every rank\n"
DIVIDE = "        p.grad /= world_size\n"
LAST = "            with nullcontext() if last else model.no_sync():"
DONE = "    done = moe.experts[rank](received)"

CASES = [
    # exercise 1: crashes, an unshuffled sampler, a hand-made split, a loss that differs from step 0
    Case("1", "a typo in the logged loss", "crash-name",
         (("global_loss = summed.item() / world_size", "global_loss = summed.item() / world_sise"),), group=R),
    Case("1", "device_ids given on the CPU", "crash-device",
         (("model = DDP(WaveNet().to(device))", "model = DDP(WaveNet().to(device), device_ids=[local_rank])"),),
         group=R),
    Case("1", "sampler without shuffling", "no-shuffle",
         (("DistributedSampler(train_set, seed=args.seed)", "DistributedSampler(train_set, seed=args.seed, shuffle=False)"),),
         group=R),
    Case("1", "a hand-made split", "hand-split",
         (("DataLoader(train_set, args.batch_size, sampler=sampler)",
           "DataLoader(Subset(train_set, range(rank, len(train_set), world_size)), args.batch_size, shuffle=True)"),
          ("        sampler.set_epoch(epoch)  # DDP step 4", "        pass  # DDP step 4")), group=R),
    Case("1", "the loss summed over the batch", "first-loss",
         (("criterion = nn.CrossEntropyLoss()", "criterion = nn.CrossEntropyLoss(reduction='sum')"),), group=R),
    # exercise 2: a broadcast from each rank's own source, an async all-reduce never waited on, a broadcast as average
    Case("2", "broadcast from the rank's own source", "src-differs",
         (("dist.broadcast(p.data, src=0)", "dist.broadcast(p.data, src=dist.get_rank())"),), group=R),
    Case("2", "async all_reduce never waited on", "not-waited",
         ((SUM, "        dist.all_reduce(p.grad, async_op=True)  # the sum, in the background\n"),), group=R),
    Case("2", "rank 0's gradient broadcast as the average", "broadcast-grads",
         ((SUM + DIVIDE, "        dist.broadcast(p.grad, src=0)  # the same gradient on every rank\n"),), group=R),
    # exercise 5: parameters averaged after the step, the gradients averaged too
    Case("5", "parameters averaged in place of the broadcast", "params-averaged",
         (("            dist.broadcast(p.data, src=owner[p])",
           "            dist.all_reduce(p.data)\n            p.data /= world_size"),), group=R),
    # exercise 6c: no_sync with the condition inverted, and off by one
    Case("6c", "no_sync's condition inverted", "unsynced",
         ((LAST, "            with model.no_sync() if last else nullcontext():"),), group=R),
    Case("6c", "the last micro-batch off by one", "unsynced",
         (("last = micro == args.accum - 1", "last = micro == args.accum"),), group=R),
    # exercise 7: the gradient divided in Reduce's backward; dist.reduce for the all-reduce
    Case("7", "Reduce's backward divides by the world size", "backward-divided",
         (("        return grad  # already whole on every rank",
           "        return grad / dist.get_world_size()  # already whole on every rank"),), group=R),
    Case("7", "dist.reduce in Reduce's forward", "reduce-one-rank",
         (("dist.all_reduce(out)  # partial sums", "dist.reduce(out, dst=0)  # partial sums"),), group=R),
    # exercise 8: a crash of its own
    Case("8", "a typo on stage 1", "crash-name",
         (("            outputs[i].backward()\n", "            output[i].backward()\n"),), group=R),
    # exercise 9: a crash, dropped tokens, the inputs sent back
    Case("9", "gates multiplied without a feature axis", "crash-shape",
         (("    return gate[:, None] * out", "    return gate * out"),), group=R),
    Case("9", "tokens over the capacity dropped", "dropped",
         ((DONE, DONE + "\n    done = done * (torch.arange(len(done)) < max(len(x) // world_size, 1))[:, None]"),),
         group=R),
    Case("9", "the combine sends back the received inputs", "combine-inputs",
         (("back = all_to_all_single(done,", "back = all_to_all_single(received,"),), group=R),
]

TESTED_RUNGS = ("1/a typo in the logged loss", "1/sampler without shuffling", "2/broadcast from the rank's own source",
                "6c/no_sync's condition inverted", "9/the combine sends back the received inputs")
