"""Cut the course's small GPT (course.gpt) into pipeline stages (notebook 11): one home for the split.

    from course.gpt_stages import GPTStage, layer_ranges
    model = GPT(cfg)                                   # the whole model, built the same way on every rank
    stage = GPTStage(model, stage_index=1, num_stages=2)   # blocks 1 of 2, ln_f and head: the last stage
    y = stage(x)          # first stage: token ids -> activations; last stage: activations -> logits

Every rank builds the whole model from the same seed and keeps only its stage's modules, so a stage's
weights equal the one-process model's and its ``state_dict`` keys are the GPT's own names
(``tok_emb.weight``, ``blocks.3.attn.q.weight``, ``head.weight``): the stages' state dicts merged are a
GPT state dict. The first stage holds the embeddings, the last the final LayerNorm and the head; the
blocks are spread as evenly as they go (``layer_ranges``). The model file stays a plain model: this
module only picks its parts.
"""

import torch
from torch import nn


def layer_ranges(n_layer: int, num_stages: int) -> list[range]:
    """The blocks of each stage: as even as they go, earlier stages getting the extra one."""
    if num_stages < 1 or n_layer < num_stages:
        raise ValueError(f"{n_layer} blocks cannot be cut into {num_stages} stages with a block each "
                         f"(use at least {num_stages} blocks: --n-layer)")
    base, extra = divmod(n_layer, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (s < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class GPTStage(nn.Module):
    """Stage ``stage_index`` of ``num_stages`` of a GPT: its blocks, plus the embeddings (first) or the head (last)."""

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int):
        super().__init__()
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        layers = layer_ranges(len(model.blocks), num_stages)[stage_index]
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        # a ModuleDict keyed by the block's index in the whole model keeps the names "blocks.<i>. ..."
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        if self.is_first:  # x: token ids (B, T)
            x = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():  # x: activations (B, T, n_embd)
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x
