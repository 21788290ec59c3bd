"""A small mixture-of-experts layer (notebook 12): a router sends each token to one of ``n_experts`` MLPs.

    from course.moe import MoE, moe_layer, moe_tokens
    moe = moe_layer(n_experts=4, seed=0)      # the same layer on every rank that builds it with this seed
    x = moe_tokens(rank, tokens=32, seed=0)   # a rank's own tokens, (tokens, width)
    y = moe(x)                                # every expert here: the one-process layer

Top-1 routing: token t goes to expert argmax(router(t)) and its output is scaled by that expert's
probability (so the router learns through the gate). ``moe_layer.py`` and exercise 9 split it over the
ranks, one expert per rank, and compare with ``MoE.forward`` on all the tokens.
"""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 16


class Expert(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """Top-1 routing: token t goes to expert argmax(router(t)), its output is scaled by that expert's probability."""

    def __init__(self, width, n_experts):
        super().__init__()
        self.router = nn.Linear(width, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(n_experts))

    def route(self, x):
        """(gate, expert) per token: the chosen expert's probability and its index."""
        probs = self.router(x).softmax(-1)
        gate, expert = probs.max(-1)
        return gate, expert

    def forward(self, x):  # one process: every expert is here
        gate, expert = self.route(x)
        out = torch.zeros_like(x)
        for e, layer in enumerate(self.experts):
            mine = expert == e
            out[mine] = layer(x[mine])
        return gate[:, None] * out


def moe_layer(n_experts: int, seed: int = 0, width: int = WIDTH) -> MoE:
    """The layer every rank builds identically from ``seed``."""
    torch.manual_seed(seed)
    return MoE(width, n_experts)


def moe_tokens(rank: int, tokens: int, seed: int = 0, width: int = WIDTH, offset: int = 100) -> torch.Tensor:
    """Rank ``rank``'s own tokens, the same wherever they are made (``offset`` picks another stream)."""
    g = torch.Generator().manual_seed(1000 * seed + offset + rank)
    return torch.randn(tokens, width, generator=g)
