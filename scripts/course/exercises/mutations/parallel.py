"""The test set of the exercises of notebooks 10-12 (7: tensor parallelism, 8: GPipe, 9: expert dispatch):
realistic mistakes and correct alternatives, as edits of each reference solution (see
``course.exercises.mutations``)."""

from course.exercises.mutations import Case

# ------------------------------------------------------------------ exercise 7: tensor parallelism by hand
FWD = "dist.all_reduce(out)  # partial sums"
BWD = "dist.all_reduce(grad)  # each rank has its columns'"
FC_W = "full.weight.detach().chunk(world, dim=0)[rank].clone())  # out x in"
FC_B = "full.bias.detach().chunk(world, dim=0)[rank].clone())"
PROJ_W = "full.weight.detach().chunk(world, dim=1)[rank].clone())\n"
ROW_OUT = "        return Reduce.apply(F.linear(x_slice, self.weight)) + self.bias"
EX7 = [
    Case("7", "no all-reduce after the row-parallel layer", "no-forward-reduce",
         (("        " + FWD, "        # partial sums"),)),
    Case("7", "no all-reduce in Copy's backward", "no-backward-reduce", (("        " + BWD, "        # each rank has its columns'"),)),
    Case("7", "Reduce's backward sums again", "backward-summed-twice",
         (("        return grad  # already whole on every rank",
           "        dist.all_reduce(grad)\n        return grad  # already whole on every rank"),)),
    Case("7", "forward averaged", "forward-averaged", ((FWD, FWD.replace("(out)", "(out, op=dist.ReduceOp.AVG)")),),
         "averaged"),
    Case("7", "backward averaged", "backward-averaged", ((BWD, BWD.replace("(grad)", "(grad, op=dist.ReduceOp.AVG)")),),
         "averaged"),
    Case("7", "fc cut along its inputs", "shapes", ((FC_W, FC_W.replace("dim=0", "dim=1")),), "shape"),
    Case("7", "proj cut along its outputs", "shapes", ((PROJ_W, PROJ_W.replace("dim=1", "dim=0")),), "shape"),
    Case("7", "Copy's forward sums", "copy-forward-reduce",
         (("    def forward(ctx, x):\n        return x\n",
           "    def forward(ctx, x):\n        x = x.clone()\n        dist.all_reduce(x)\n        return x\n"),), "own-hint"),
    Case("7", "proj's bias added before the sum", "bias-twice",
         ((ROW_OUT, "        return Reduce.apply(F.linear(x_slice, self.weight, self.bias))"),), "own-hint"),
    Case("7", "proj's columns of the other rank", "slices",
         ((PROJ_W, "full.weight.detach().chunk(world, dim=1)[world - 1 - rank].clone())\n"),), "own-hint"),
    Case("7", "a stride split", "pass",
         (("full.weight.detach().chunk(world, dim=0)[rank].clone()", "full.weight.detach()[rank::world].clone()"),
          (FC_B, "full.bias.detach()[rank::world].clone())"),
          ("full.weight.detach().chunk(world, dim=1)[rank].clone()", "full.weight.detach()[:, rank::world].clone()")),
         "false-fail"),
    Case("7", "the sum by all_gather", "pass",
         (("        out = partial.clone()\n        " + FWD + " over the rows -> the whole output on every rank\n        return out\n",
           ("        parts = [torch.empty_like(partial) for _ in range(dist.get_world_size())]\n"
           "        dist.all_gather(parts, partial.contiguous())\n        return torch.stack(parts).sum(0)\n")),)),
]

# ------------------------------------------------------------------ exercise 8: GPipe by hand
SCALED = "loss = loss_fn(stage(h), ym) / m"
EX8 = [
    Case("8", "micro-batch losses not scaled", "not-scaled", ((SCALED, "loss = loss_fn(stage(h), ym)"),)),
    Case("8", "scaled by the batch size", "loss-scale", ((SCALED, "loss = loss_fn(stage(h), ym) / args.batch_size"),),
         "own-hint"),
    Case("8", "stage 0 backward in reverse order", "stage0-backward", (("outputs[i].backward(grad)",
                                                                       "outputs[m - 1 - i].backward(grad)"),)),
    Case("8", "the gradient never sent back", "hang", (("dist.send(inputs[i].grad, dst=0)", "pass"),)),
    Case("8", "targets of another micro-batch", "stage1",
         (("zip(x.chunk(m), y.chunk(m))", "zip(x.chunk(m), reversed(y.chunk(m)))"),)),
    # rank 1 sends a gradient that does not exist (its input never asked for one): its own crash, not a hang
    Case("8", "stage 1's input without requires_grad", "crash-none", (("            h.requires_grad_()\n", ""),), "crash"),
    Case("8", "stage 0's backward without the received gradient", "crash-grad",
         (("outputs[i].backward(grad)", "outputs[i].backward()"),), "crash"),
    Case("8", "backwards from the last micro-batch on both ranks", "pass",
         (("    for i in range(m):  # all backwards", "    for i in reversed(range(m)):  # all backwards"),)),
    Case("8", "each loss weighted by its share of the batch", "pass",
         ((SCALED, "loss = loss_fn(stage(h), ym) * len(ym) / args.batch_size"),)),
]

# ------------------------------------------------------------------ exercise 9: expert dispatch and combine
DISPATCH = "received = all_to_all_single(x[order], recv_splits, send_splits, dist.group.WORLD)"
COMBINE = "back = all_to_all_single(done, send_splits, recv_splits, dist.group.WORLD)"
UNSORT = "out = torch.empty_like(back).index_copy(0, order, back)"
EX9 = [
    Case("9", "dispatch splits swapped", "splits",
         ((DISPATCH, DISPATCH.replace("recv_splits, send_splits", "send_splits, recv_splits")),), "splits"),
    Case("9", "combine splits swapped", "splits",
         ((COMBINE, COMBINE.replace("send_splits, recv_splits", "recv_splits, send_splits")),), "splits"),
    Case("9", "the counts never exchanged", "splits",
         (("    dist.all_to_all_single(recv, send)  # how many tokens come from each rank\n",
           "    recv = send.clone()  # as many as it sends?\n"),), "splits"),
    Case("9", "counts without minlength", "counts", (("torch.bincount(expert, minlength=world_size)",
                                                       "torch.bincount(expert)"),), "false-pass"),
    Case("9", "outputs not put back", "combine-order", ((UNSORT, "out = back"),)),
    Case("9", "outputs gathered, not scattered", "combine-order", ((UNSORT, "out = back[order]"),)),
    Case("9", "tokens sent unsorted", "outputs", ((DISPATCH, DISPATCH.replace("x[order]", "x")),)),
    Case("9", "every rank runs expert 0", "wrong-expert", (("moe.experts[rank](received)", "moe.experts[0](received)"),),
         "own-hint"),
    Case("9", "a collective without autograd", "no-grad-back",
         (("    " + DISPATCH, ("    received = x.new_empty(sum(recv_splits), x.shape[1])\n"
                               "    dist.all_to_all_single(received, x[order].detach(), recv_splits, send_splits)")),)),
    Case("9", "counts by comparison", "pass",
         (("torch.bincount(expert, minlength=world_size)",
           "torch.stack([(expert == j).sum() for j in range(world_size)])"),)),
    Case("9", "an unstable sort, put back by indexing", "pass",
         (("torch.argsort(expert, stable=True)", "torch.argsort(expert)"),
          (UNSORT, "out = torch.empty_like(back)\n    out[order] = back")), "false-fail"),
]

CASES = [*EX7, *EX8, *EX9]
