"""The held-out set of issue 55 (item 4): realistic mistakes written from the exercise text and the reference
solutions alone, by someone who had not read the checker's rules, before any rule was changed for them. No rule
may be written from these cases; the benchmark (python -m course.bench_checker --group held-out-55) measures
them once and its figures go to the checker's documentation as they come out. ``expect`` is "unknown": each
case's comment says what the mistake is, and the first hint is judged by how a learner reads it.
"""

from course.exercises.mutations import Case

H = "held-out-55"

EX1 = [
    # The sampler is built without seed=args.seed: it shuffles with seed 0, so with --seed 3 every rank reads
    # another order than the single-device run, and every logged loss differs.
    Case("1", "sampler without the seed", "unknown",
         (("DistributedSampler(train_set, seed=args.seed)", "DistributedSampler(train_set)"),), group=H),
    # --batch-size read as the global batch and split again: 2 x 8 = 16 samples per step instead of 32.
    Case("1", "batch size divided by the world size", "unknown",
         (("DataLoader(train_set, args.batch_size, sampler=sampler)",
           "DataLoader(train_set, args.batch_size // world_size, sampler=sampler)"),), group=H),
    # shuffle=True kept next to the sampler "to keep shuffling": DataLoader refuses both and raises at once.
    Case("1", "shuffle and sampler together", "unknown",
         (("DataLoader(train_set, args.batch_size, sampler=sampler)",
           "DataLoader(train_set, args.batch_size, shuffle=True, sampler=sampler)"),), group=H),
    # The global loss is kept as a tensor (no .item()): the log cannot be written, json.dumps raises on
    # rank 0.
    Case("1", "global loss left a tensor", "unknown",
         (("global_loss = summed.item() / world_size", "global_loss = summed / world_size"),), group=H),
    # Only rank 0 (the one that writes the log) all-reduces the loss: rank 1 skips the collective, so the
    # ranks' collectives no longer match (a hang, or a mismatch with DDP's gradient all-reduce).
    Case("1", "loss all-reduced on the writer only", "unknown",
         (("            dist.all_reduce(summed)  #",
           ("            if rank == 0:  # only rank 0 writes the log, so only it needs the global loss\n"
            "                dist.all_reduce(summed)  #")),), group=H),
    # Validation split into contiguous halves of len // world_size: the 301st sample is in no rank's part,
    # so the counts add up to 300.
    Case("1", "validation halves drop the odd sample", "unknown",
         (("Subset(val_set, range(rank, len(val_set), world_size))",
           ("Subset(val_set, range(rank * (len(val_set) // world_size), "
            "(rank + 1) * (len(val_set) // world_size)))")),), group=H),
    # The validation counts are summed and then divided by the world size like the loss: half the true
    # counts (and floats).
    Case("1", "validation counts averaged", "unknown",
         (("correct, total = counts.tolist()", "correct, total = (counts / world_size).tolist()"),), group=H),
]

_SUM_THEN_DIVIDE = ("        dist.all_reduce(p.grad)  # the sum over ranks (ReduceOp.SUM), in place, on every rank\n"
                    "        p.grad /= world_size\n")

EX2 = [
    # Every rank broadcasts from itself ("each shares its weights"): the ranks disagree on the root, so the
    # copies never become rank 0's (mismatched collective: wrong weights, an error or a hang).
    Case("2", "broadcast from every rank's own rank", "unknown",
         (("dist.broadcast(p.data, src=0)  # in place: rank 0 sends, every other rank receives",
           "dist.broadcast(p.data, src=dist.get_rank())  # every rank shares its weights"),), group=H),
    # One broadcast of parameters_to_vector(...): that vector is a new tensor, and it is never copied back
    # into the parameters, so the ranks still start from different weights.
    Case("2", "broadcast of a flattened copy", "unknown",
         (("    for p in model.parameters():\n        dist.broadcast(p.data, src=0)",
           ("    flat = torch.nn.utils.parameters_to_vector(model.parameters())  # all the weights, one tensor\n"
            "    dist.broadcast(flat, src=0)")),), group=H),
    # The gradients are averaged after optimizer.step(): each rank steps with its own half-batch gradient.
    Case("2", "average after the step", "unknown",
         (("        average_gradients(model, world_size)\n        optimizer.step()\n",
           "        optimizer.step()\n        average_gradients(model, world_size)\n"),), group=H),
    # The parameters are averaged instead of the gradients: they are already equal, and each rank then steps
    # with its own gradient, so the copies drift apart.
    Case("2", "parameters averaged, not the gradients", "unknown",
         ((_SUM_THEN_DIVIDE, "        dist.all_reduce(p.data)  # average the copies\n        p.data /= world_size\n"),),
         group=H),
    # all_reduce(p.grad / world_size) reduces a temporary: p.grad itself is never changed, each rank keeps
    # its own gradient.
    Case("2", "all-reduce of a temporary", "unknown",
         ((_SUM_THEN_DIVIDE, "        dist.all_reduce(p.grad / world_size)  # the average, in one line\n"),),
         group=H),
    # named_parameters() yields (name, tensor) tuples: p.data raises AttributeError before training starts.
    Case("2", "named_parameters tuples", "unknown",
         (("    for p in model.parameters():\n        dist.broadcast(",
           "    for p in model.named_parameters():\n        dist.broadcast("),), group=H),
    # //= instead of /=: a floor division of the summed gradient, every gradient rounded down to an integer.
    Case("2", "floor division of the sum", "unknown",
         (("        p.grad /= world_size\n", "        p.grad //= world_size\n"),), group=H),
]

EX3 = [
    # num_samples is always rounded down, also without drop_last: the padded shares are one short (and a
    # data set smaller than the number of ranks yields nothing).
    Case("3", "share always rounded down", "unknown",
         (("self.n // num_replicas if drop_last else math.ceil(self.n / num_replicas)",
           "self.n // num_replicas"),), group=H),
    # The generator is seeded with the seed alone: set_epoch has no effect, every epoch the same order.
    Case("3", "seed without the epoch", "unknown",
         (("g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)"),), group=H),
    # The seeded generator is made but not passed to randperm: the permutation comes from the global RNG,
    # differs between ranks and runs, and advances the global generator.
    Case("3", "generator not passed to randperm", "unknown",
         (("torch.randperm(self.n, generator=g)", "torch.randperm(self.n)"),), group=H),
    # Padding done once (if instead of while): when the data set is less than half the padded length
    # (e.g. 1 sample on 4 ranks), the list stays too short.
    Case("3", "padding repeated only once", "unknown",
         (("        while len(indices) < total:", "        if len(indices) < total:"),), group=H),
    # The cut to total is left out: with drop_last the tail is never dropped, ranks yield more than
    # num_samples.
    Case("3", "no cut with drop_last", "unknown",
         (("        indices = indices[:total]\n", ""),), group=H),
    # Each rank takes a contiguous block instead of every num_replicas-th index: the right number of
    # indices, but not the ones DistributedSampler gives (a step's batches are no longer consecutive).
    Case("3", "contiguous blocks", "unknown",
         (("return iter(indices[self.rank::self.num_replicas])",
           "return iter(indices[self.rank * self.num_samples:(self.rank + 1) * self.num_samples])"),), group=H),
    # Without shuffle the indices are a range, not a list: padding with += raises TypeError whenever the
    # size is not a multiple of the ranks.
    Case("3", "range instead of a list", "unknown",
         (("indices = list(range(self.n))", "indices = range(self.n)"),), group=H),
]

EX4 = [
    # register_hook (a gradient hook) instead of register_post_accumulate_grad_hook: the hook receives the
    # gradient, not the parameter, and bucket_of[grad] raises KeyError inside backward().
    Case("4", "gradient hook instead of post-accumulate hook", "unknown",
         (("p.register_post_accumulate_grad_hook(self.on_grad_ready)", "p.register_hook(self.on_grad_ready)"),),
         group=H),
    # async_op=True forgotten: all_reduce returns None, and finish() calls None.wait() (AttributeError); no
    # overlap either.
    Case("4", "all-reduce not asynchronous", "unknown",
         (("dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat)"),), group=H),
    # The averaged slices are copied into the parameters (q.data) instead of their gradients: the weights
    # are overwritten with gradients, and the step uses the un-averaged .grad.
    Case("4", "averages written into the weights", "unknown",
         (("q.grad.copy_(flat[offset:offset + q.numel()]", "q.data.copy_(flat[offset:offset + q.numel()]"),),
         group=H),
    # The offset is never advanced: every gradient of a bucket gets the first slice of the flat tensor.
    Case("4", "offset not advanced", "unknown",
         (("                offset += q.numel()\n", ""),), group=H),
    # The gradients are concatenated without flatten(): a (1, 64) weight and a (1,) bias cannot be
    # concatenated, torch.cat raises inside backward().
    Case("4", "cat without flatten", "unknown",
         (("torch.cat([q.grad.flatten() for q in self.buckets[i]])", "torch.cat([q.grad for q in self.buckets[i]])"),),
         group=H),
    # pending is reassigned instead of appended to: only the last started bucket is waited on and written
    # back, the other buckets keep their local gradients (and their handles are never waited on).
    Case("4", "pending overwritten", "unknown",
         (("self.pending.append((dist.all_reduce(flat, async_op=True), flat, i))",
           "self.pending = [(dist.all_reduce(flat, async_op=True), flat, i)]"),), group=H),
]

EX5 = [
    # The owned parameters are taken by position (every world_size-th) instead of from owner: the rank that
    # updates a parameter is not the one that broadcasts it, so some updates are lost or overwritten.
    Case("5", "owned parameters by position", "unknown",
         (("mine = [p for p in model.parameters() if owner[p] == rank]",
           "mine = list(model.parameters())[rank::world_size]"),), group=H),
    # Each rank broadcasts only its own parameters, from itself: the ranks call broadcast on different
    # tensors with different roots, so nobody receives the other's updates (mismatched collectives).
    Case("5", "broadcast only the owned ones", "unknown",
         (("        for p in model.parameters():\n            dist.broadcast(p.data, src=owner[p])\n",
           "        for p in mine:\n            dist.broadcast(p.data, src=rank)\n"),), group=H),
    # The parameters are broadcast before optimizer.step(): the owners send the old values, then update
    # only their own copy, so the ranks differ after every step.
    Case("5", "owners broadcast before their step", "unknown",
         (("        optimizer.step()  # updates this rank's parameters only\n", ""),
          ("            dist.broadcast(p.data, src=owner[p])\n",
           ("            dist.broadcast(p.data, src=owner[p])\n"
            "        optimizer.step()  # updates this rank's parameters only\n"))), group=H),
    # The updated parameters are all-reduced instead of broadcast from their owner: each becomes the sum of
    # the owner's new value and the other rank's stale one.
    Case("5", "all-reduce of the parameters", "unknown",
         (("dist.broadcast(p.data, src=owner[p])", "dist.all_reduce(p.data)"),), group=H),
    # optimizer.zero_grad() instead of model.zero_grad(): the gradients of the parameters a rank does not
    # own are never cleared, accumulate over steps and enter the average from step 2 on.
    Case("5", "optimizer.zero_grad clears only the owned", "unknown",
         (("model.zero_grad()  # every gradient", "optimizer.zero_grad()  # every gradient"),), group=H),
    # mine is a generator expression, not a list: Adam consumes it, and len(mine) in the final print raises
    # TypeError on every rank.
    Case("5", "owned parameters as a generator", "unknown",
         (("mine = [p for p in model.parameters() if owner[p] == rank]",
           "mine = (p for p in model.parameters() if owner[p] == rank)"),), group=H),
]

_RANK0_EVALUATES = ("        val_mse, count = evaluate(model, val_loader, device)\n        if rank == 0:\n",
                    "        if rank == 0:\n            val_mse, count = evaluate(model, val_loader, device)\n")

EX6A = [
    # "Fixed" by deleting the all-reduce in evaluate(), rank 0 still evaluating alone: no hang, but the MSE
    # and the count are rank 0's half of the validation set only.
    Case("6a", "all-reduce removed from evaluate", "unknown",
         (_RANK0_EVALUATES, ("    dist.all_reduce(sums)\n", "")), group=H),
    # "Fixed" by deleting the barrier, rank 0 still evaluating alone: rank 1 runs ahead into the next epoch,
    # and evaluate()'s all-reduce meets DDP's gradient all-reduce (mismatch, error or hang).
    Case("6a", "barrier removed", "unknown",
         (_RANK0_EVALUATES, ("        dist.barrier()  # the others wait until rank 0 has saved\n", "")),
         group=H),
    # all_reduce changed to reduce(dst=0) "since only rank 0 needs it", rank 0 still evaluating alone:
    # reduce is a collective too, rank 1 never calls it, still a hang.
    Case("6a", "reduce to rank 0 instead", "unknown",
         (_RANK0_EVALUATES, ("    dist.all_reduce(sums)\n", "    dist.reduce(sums, dst=0)\n")), group=H),
]

EX6B = [
    # set_epoch moved into the batch loop: the loader's iterator (and its order) is made before it runs, so
    # epoch 1 still uses epoch 0's order.
    Case("6b", "set_epoch inside the batch loop", "unknown",
         (("        sampler.set_epoch(epoch)\n        losses = []\n", "        losses = []\n"),
          ("        for x, y in train_loader:\n",
           "        for x, y in train_loader:\n            sampler.set_epoch(epoch)\n")), group=H),
    # The global RNG is reseeded each epoch instead of set_epoch: DistributedSampler shuffles with its own
    # seed + epoch, so every epoch still repeats the same order.
    Case("6b", "manual_seed instead of set_epoch", "unknown",
         (("        sampler.set_epoch(epoch)\n",
           "        torch.manual_seed(args.seed + epoch)  # a new shuffle each epoch\n"),), group=H),
    # set_epoch(epoch + 1) before the loop ("the next epoch", as the old line said): every epoch is one
    # order ahead, epoch 0 no longer matches the reference.
    Case("6b", "set_epoch one ahead", "unknown",
         (("        sampler.set_epoch(epoch)\n",
           "        sampler.set_epoch(epoch + 1)  # reshuffle for the next epoch\n"),), group=H),
]

EX6C = [
    # The loss divided by accum and again by the world size ("DDP sums the ranks"): DDP already averages,
    # so every step is world_size times too small.
    Case("6c", "loss divided by accumulation and world size", "unknown",
         (("(loss / args.accum).backward()", "(loss / (args.accum * dist.get_world_size())).backward()"),),
         group=H),
    # no_sync on the last micro-batch instead of the others: the earlier micro-batches are all-reduced, the
    # last one's gradient stays local, so the ranks step differently.
    Case("6c", "no_sync inverted", "unknown",
         (("with nullcontext() if last else model.no_sync():",
           "with model.no_sync() if last else nullcontext():"),), group=H),
    # zero_grad moved into the micro-batch loop: each micro-batch clears the previous ones, the step uses
    # the last micro-batch only (a quarter of its gradient).
    Case("6c", "zero_grad in the micro-batch loop", "unknown",
         (("        optimizer.zero_grad()\n        for micro in range(args.accum):\n",
           "        for micro in range(args.accum):\n            optimizer.zero_grad()\n"),), group=H),
]

EX7 = [
    # Copy's backward averages instead of summing (divides by the world size as in DDP): the input's
    # gradient is half what it should be.
    Case("7", "input gradient averaged", "unknown",
         (("the sum\n        return grad\n",
           "the sum\n        return grad / dist.get_world_size()  # averaged over the ranks\n"),), group=H),
    # The row-parallel bias is sliced like the column-parallel one: a (width/2) bias cannot be added to the
    # (tokens, width) output, a shape error in forward.
    Case("7", "row bias sliced", "unknown",
         (("nn.Parameter(full.bias.detach().clone())  # added once, after the sum",
           "nn.Parameter(full.bias.detach().chunk(world, dim=0)[rank].clone())"),), group=H),
    # The bias passed to F.linear inside the all-reduce: every rank adds it, so the output carries it
    # world_size times.
    Case("7", "row bias inside the all-reduce", "unknown",
         (("Reduce.apply(F.linear(x_slice, self.weight)) + self.bias",
           "Reduce.apply(F.linear(x_slice, self.weight, self.bias))"),), group=H),
    # The column slice kept as a plain tensor, not an nn.Parameter: forward is right, but it gets no
    # gradient (fc_weight_grad is None).
    Case("7", "column weight not a parameter", "unknown",
         (("self.weight = nn.Parameter(full.weight.detach().chunk(world, dim=0)[rank].clone())",
           "self.weight = full.weight.detach().chunk(world, dim=0)[rank].clone()"),), group=H),
    # The column layer's rows taken strided (rank::world, as for data in exercise 2) while its bias and the
    # row layer's columns are contiguous chunks: the hidden units no longer line up, the output is wrong.
    Case("7", "column rows strided", "unknown",
         (("nn.Parameter(full.weight.detach().chunk(world, dim=0)[rank].clone())",
           "nn.Parameter(full.weight.detach()[rank::world].clone())"),), group=H),
    # all_gather + cat instead of a sum in Reduce.forward: the partial outputs are concatenated,
    # (tokens, 2*width), and adding the bias fails with a shape error.
    Case("7", "partials gathered instead of summed", "unknown",
         (("        out = partial.clone()\n        dist.all_reduce(out)",
           ("        parts = [torch.empty_like(partial) for _ in range(dist.get_world_size())]\n"
            "        dist.all_gather(parts, partial)  # every rank's piece of the output\n"
            "        out = torch.cat(parts, dim=-1)")),), group=H),
]

EX8 = [
    # Each micro-batch's loss divided by the batch size instead of the number of micro-batches: the mean
    # loss is already per sample, so all gradients are batch_size/m times too small.
    Case("8", "loss divided by the batch size", "unknown",
         (("loss = loss_fn(stage(h), ym) / m", "loss = loss_fn(stage(h), ym) / args.batch_size"),), group=H),
    # The micro-batch's loss computed against the whole batch's targets: logits of B/m rows against targets
    # of B rows, cross_entropy raises a shape error on rank 1.
    Case("8", "targets of the whole batch", "unknown",
         (("loss = loss_fn(stage(h), ym) / m", "loss = loss_fn(stage(h), y) / m"),), group=H),
    # Rank 1 sends its input activation back instead of that input's gradient: stage 0 backpropagates
    # activations, its gradients are wrong.
    Case("8", "activation sent back instead of its gradient", "unknown",
         (("dist.send(inputs[i].grad, dst=0)", "dist.send(inputs[i], dst=0)"),), group=H),
    # The gradient is sent before rank 1's backward of that micro-batch: inputs[i].grad is still None, send
    # raises on rank 1 and rank 0 waits for it.
    Case("8", "gradient sent before the backward", "unknown",
         (("            outputs[i].backward()\n", ""),
          ("back to stage 0\n", "back to stage 0\n            outputs[i].backward()\n")), group=H),
    # The received gradient divided by m again on stage 0: the loss is already each micro-batch's share, so
    # stage 0's gradients are m times too small (stage 1's are right).
    Case("8", "stage 0 gradient scaled again", "unknown",
         (("outputs[i].backward(grad)", "outputs[i].backward(grad / m)"),), group=H),
    # Stage 0 backpropagates `out`, the last forward's output left over from the loop, for every i: the
    # second backward through the same graph raises on rank 0.
    Case("8", "last output reused for every backward", "unknown",
         (("outputs[i].backward(grad)", "out.backward(grad)"),), group=H),
]

_COMBINE = "back = all_to_all_single(done, send_splits, recv_splits, dist.group.WORLD)"

EX9 = [
    # bincount without minlength: when no token of a rank goes to the last expert (the check's small token
    # counts), the counts have fewer than world_size entries and the count exchange fails.
    Case("9", "bincount without minlength", "unknown",
         (("torch.bincount(expert, minlength=world_size)", "torch.bincount(expert)"),), group=H),
    # The counts turned into a list right away: torch.empty_like(send) gets a list and raises TypeError.
    Case("9", "counts as a list", "unknown",
         (("send = torch.bincount(expert, minlength=world_size)",
           "send = torch.bincount(expert, minlength=world_size).tolist()"),), group=H),
    # The tokens are dispatched in their own order, not grouped by destination (x instead of x[order]): the
    # first counts go to rank 0 whatever their expert, and index_copy puts outputs in the wrong rows.
    Case("9", "tokens dispatched unsorted", "unknown",
         (("all_to_all_single(x[order], recv_splits", "all_to_all_single(x, recv_splits"),), group=H),
    # The dispatch uses dist.all_to_all_single into a new buffer (not differentiable): the outputs are
    # right, but no gradient flows back through the experts to the tokens; x.grad has only the router's part.
    Case("9", "dispatch with the non-differentiable collective", "unknown",
         (("    received = all_to_all_single(x[order], recv_splits, send_splits, dist.group.WORLD)",
           ("    received = x.new_empty(sum(recv_splits), x.shape[1])\n"
            "    dist.all_to_all_single(received, x[order], recv_splits, send_splits)")),), group=H),
    # The combine sends back the received tokens, not the expert's outputs (wrong variable): every output
    # is its own input scaled by the gate, and the experts get no gradient.
    Case("9", "received sent back instead of the outputs", "unknown",
         ((_COMBINE, _COMBINE.replace("(done,", "(received,")),), group=H),
    # The expert's outputs detached before the combine (as before dist.send in notebook 11): the outputs are
    # right, but the experts get no gradient and x.grad loses the experts' part.
    Case("9", "outputs detached before the combine", "unknown",
         ((_COMBINE, _COMBINE.replace("(done,", "(done.detach(),")),), group=H),
]

CASES = [*EX1, *EX2, *EX3, *EX4, *EX5, *EX6A, *EX6B, *EX6C, *EX7, *EX8, *EX9]
