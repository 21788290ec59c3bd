"""The test set of the core exercises (1, 2 and the debugging lab 6a-c): realistic mistakes and correct
alternatives, as edits of each reference solution (see ``course.exercises.mutations``)."""

from course.exercises.mutations import Case

# ------------------------------------------------------------------ exercise 1: convert a script to DDP
LOSS = "global_loss = summed.item() / world_size"
LOSS_REDUCE = "dist.all_reduce(summed)  # DDP step 5"
VAL_LOADER = "DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 100)"
SAVE = "torch.save(model.module.state_dict()"

EX1 = [
    Case("1", "every rank writes", "every-rank-writes",
         (("    if rank == 0:  # DDP step 5: one process writes", "    if True:  # every rank"),)),
    Case("1", "rank 0's own loss", "local-loss", ((LOSS, "global_loss = loss.item()"),)),
    Case("1", "loss summed, not averaged", "loss-summed", ((LOSS, "global_loss = summed.item()"),), "averaged"),
    Case("1", "loss averaged twice", "loss-halved",
         ((LOSS_REDUCE, "dist.all_reduce(summed, op=dist.ReduceOp.AVG)  # DDP step 5"),), "averaged"),
    Case("1", "sampler at its default seed", "sampler-seed",
         (("DistributedSampler(train_set, seed=args.seed)", "DistributedSampler(train_set)"),)),
    Case("1", "no set_epoch", "no-set-epoch",
         (("        sampler.set_epoch(epoch)  # DDP step 4", "        pass  # DDP step 4"),)),
    Case("1", "batch divided by the world size", "batch-halved",
         (("DataLoader(train_set, args.batch_size, sampler=sampler)",
           "DataLoader(train_set, args.batch_size // world_size, sampler=sampler)"),)),
    Case("1", "model not wrapped", "not-averaged",
         (("model = DDP(WaveNet().to(device))", "model = WaveNet().to(device)"), (SAVE, "torch.save(model.state_dict()"))),
    Case("1", "the wrapper's state_dict saved", "module-prefix", ((SAVE, "torch.save(model.state_dict()"),)),
    Case("1", "validation padded", "val-padded",
         ((VAL_LOADER, "DataLoader(val_set, 100, sampler=DistributedSampler(val_set, shuffle=False))"),)),
    Case("1", "validation cut", "val-dropped",
         ((VAL_LOADER, "DataLoader(val_set, 100, sampler=DistributedSampler(val_set, shuffle=False, drop_last=True))"),)),
    Case("1", "every rank validates everything", "val-twice", ((VAL_LOADER, "DataLoader(val_set, 100)"),)),
    Case("1", "validation counts not added up", "val-partial",
         (("    dist.all_reduce(counts)  # DDP step 5", "    # DDP step 5"),)),
    # rank 0 alone crashes (a tensor is not JSON): rank 1, at the barrier, then reports the closed connection
    Case("1", "a tensor logged: rank 0 crashes", "crash-json", ((LOSS, "global_loss = summed / world_size"),), "crash"),
    Case("1", "loss averaged by ReduceOp.AVG", "pass",
         ((LOSS_REDUCE, "dist.all_reduce(summed, op=dist.ReduceOp.AVG)  # DDP step 5"),
          (LOSS, "global_loss = summed.item()"))),
    Case("1", "validation split by a plain sampler", "pass",
         ((VAL_LOADER, "DataLoader(val_set, 100, sampler=range(rank, len(val_set), world_size))"),)),
    Case("1", "prefix stripped from the wrapper's state_dict", "pass",
         ((SAVE, 'torch.save({k.removeprefix("module."): v for k, v in model.state_dict().items()}'),)),
]

# ------------------------------------------------------------------ exercise 2: DDP by hand
SUM = "        dist.all_reduce(p.grad)  # the sum over ranks (ReduceOp.SUM), in place, on every rank\n"
DIVIDE = "        p.grad /= world_size\n"
FLAT = ("    grads = [p.grad for p in model.parameters()]\n    flat = torch.cat([g.flatten() for g in grads])\n"
        "    dist.all_reduce(flat)\n    flat /= world_size\n    offset = 0\n    for g in grads:\n"
        "        g.copy_(flat[offset:offset + g.numel()].view_as(g))\n        offset += g.numel()\n")

EX2 = [
    Case("2", "gradients summed", "summed", ((DIVIDE, ""),), "averaged"),
    Case("2", "averaged, then divided again", "halved",
         ((SUM, "        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n"),), "averaged"),
    Case("2", "no broadcast", "no-broadcast", (("        dist.broadcast(p.data, src=0)", "        pass"),)),
    Case("2", "rank 1's weights broadcast", "wrong-start", (("dist.broadcast(p.data, src=0)", "dist.broadcast(p.data, src=1)"),)),
    Case("2", "the last gradient not averaged", "ranks-differ",
         (("    for p in model.parameters():\n" + SUM, "    for p in list(model.parameters())[:-1]:\n" + SUM),)),
    Case("2", "parameters averaged instead of gradients", "ranks-differ",
         ((SUM, "        dist.all_reduce(p.data)\n"), (DIVIDE, "        p.data /= world_size\n"))),
    Case("2", "all_reduce on rank 0 only", "hang",
         ((SUM, "        if dist.get_rank() == 0:\n            dist.all_reduce(p.grad)  # the sum\n"),)),
    Case("2", "a typo", "crash-name", ((DIVIDE, "        p.grad /= world_sise\n"),)),
    Case("2", "a typo on rank 0 only", "crash-name",
         (("last loss (rank 0's share) {loss.item():.4f}", "last loss (rank 0's share) {losss.item():.4f}"),), "crash"),
    Case("2", "ReduceOp.AVG", "pass", ((SUM + DIVIDE, "        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n"),)),
    Case("2", "divided before the sum", "pass", ((SUM + DIVIDE, DIVIDE + SUM),)),
    Case("2", "one flat all_reduce", "pass", (("    for p in model.parameters():\n" + SUM + DIVIDE, FLAT),)),
]

# ------------------------------------------------------------------ exercise 6: the debugging lab
FIX_A = ("        # The fix: every rank evaluates its part (evaluate() all-reduces the sums: every rank must call it);\n"
         "        # only printing and saving stay on rank 0.\n        val_mse, count = evaluate(model, val_loader, device)\n"
         "        if rank == 0:\n")
BUG_A = "        if rank == 0:  # rank 0 validates, prints and saves; the others wait for it below\n" \
        "            val_mse, count = evaluate(model, val_loader, device)\n"
FIX_B = ("        # The fix: the sampler's order comes from seed + epoch, so its epoch must be set *before* the loop\n"
         "        # that reads this epoch's data (it was called after it, so that epoch 1 repeated epoch 0's order).\n"
         "        sampler.set_epoch(epoch)\n")
TRACE_B = "            losses.append(round(loss.item(), 3))\n"
FIX_C = ("                # The fix: backward() adds to .grad, so accum backward passes add up accum mean losses;\n"
         "                # dividing each by accum makes the sum the mean over the accum x batch-size samples.\n"
         "                (loss / args.accum).backward()\n")
BUG_C = "                loss.backward()  # gradients add up over the micro-batches\n"

EX6 = [
    Case("6a", "as committed", "hang", ((FIX_A, BUG_A),)),
    Case("6a", "fixed by dropping the all_reduce", "val-partial", ((FIX_A, BUG_A), ("    dist.all_reduce(sums)\n", ""))),
    Case("6a", "every rank validates the whole set", "val-twice",
         (("Subset(val_set, range(rank, len(val_set), world_size))", "val_set"),), "own-hint"),
    Case("6a", "the ranks' mean errors averaged", "val-differs",
         (("    dist.all_reduce(sums)\n    return (sums[0] / sums[1]).item(), int(sums[1].item())",
           ("    mse = sums[0] / sums[1]\n    dist.all_reduce(mse, op=dist.ReduceOp.AVG)\n    dist.all_reduce(sums)\n"
           "    return mse.item(), int(sums[1].item())")),), "averaged"),
    Case("6a", "the barrier on rank 0 only", "hang",
         (("        dist.barrier()  # the others wait", "        if rank == 0:\n            dist.barrier()  # the others wait"),)),
    Case("6a", "rank 0 validates the whole set alone", "pass",
         ((FIX_A, "        if rank == 0:\n            val_mse, count = evaluate(model, val_loader, device)\n"),
          ("    dist.all_reduce(sums)\n", ""),
          ("Subset(val_set, range(rank, len(val_set), world_size))", "val_set"))),
    Case("6b", "as committed", "same-order", ((FIX_B, ""), (TRACE_B, TRACE_B + "        sampler.set_epoch(epoch)\n"))),
    Case("6b", "no set_epoch at all", "same-order", ((FIX_B, ""),)),
    Case("6b", "set_epoch(epoch + 1) before the loop", "differs",
         (("        sampler.set_epoch(epoch)\n", "        sampler.set_epoch(epoch + 1)\n"),), "own-hint"),
    Case("6b", "sampler at its default seed", "sampler-seed",
         (("DistributedSampler(train_set, seed=args.seed)", "DistributedSampler(train_set)"),), "own-hint"),
    Case("6b", "no shuffling", "same-order",
         (("DistributedSampler(train_set, seed=args.seed)", "DistributedSampler(train_set, shuffle=False)"),)),
    Case("6b", "the next epoch set at the end of each", "pass",
         ((FIX_B, ""), (TRACE_B, TRACE_B + "        sampler.set_epoch(epoch + 1)  # for the next epoch\n"))),
    Case("6c", "as committed", "accum-not-divided", ((FIX_C, BUG_C),)),
    Case("6c", "divided twice", "factor", ((FIX_C, "                (loss / args.accum ** 2).backward()\n"),)),
    Case("6c", "the logged loss divided after backward", "accum-not-divided",
         ((FIX_C, "                loss.backward()\n                loss = loss / args.accum\n"),)),
    Case("6c", "divided by the world size too", "halved",
         ((FIX_C, "                (loss / args.accum / dist.get_world_size()).backward()\n"),), "own-hint"),
    Case("6c", "gradients cleared every micro-batch", "differs",
         (("        optimizer.zero_grad()\n        for micro in range(args.accum):\n",
           "        for micro in range(args.accum):\n            optimizer.zero_grad()\n"),), "own-hint"),
    Case("6c", "learning rate divided instead (plain SGD)", "pass",
         ((FIX_C, BUG_C), ("lr=args.lr)", "lr=args.lr / args.accum)"))),
    Case("6c", "gradients divided before the step", "pass",
         ((FIX_C, BUG_C), ("        optimizer.step()\n",
                           ("        for p in model.parameters():\n            p.grad /= args.accum\n"
                           "        optimizer.step()\n")))),
]

CASES = [*EX1, *EX2, *EX6]
