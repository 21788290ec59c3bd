"""The course's small GPT: a decoder-only transformer, nanoGPT-shaped, used by notebooks 10, 11 and 12.

    from course.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=14, block_size=8))   # defaults: 2 blocks, 4 heads, width 64
    logits = model(idx)                                    # idx (B, T) int64 -> logits (B, T, vocab_size)

Token and position embeddings, ``n_layer`` blocks (LayerNorm -> causal self-attention -> residual,
LayerNorm -> MLP -> residual), a final LayerNorm and a language-model head. The model stays plain:
tensor, sequence and pipeline parallelism are applied from outside (``parallelize_module``, splitting
``blocks``), so every layer a plan names is an ``nn.Linear`` or ``nn.LayerNorm`` with a fixed name:

    tok_emb, pos_emb, blocks.{i}.ln1, blocks.{i}.attn.{q,k,v,proj}, blocks.{i}.ln2,
    blocks.{i}.mlp.{fc,proj}, ln_f, head

Attention reads the number of heads from its input (``-1`` in ``view``), so a rank that holds
``n_head / tp`` heads' columns of q, k and v runs the same code. No weight tying (the head and the
token embedding are separate), and no dropout by default: both would make a split model differ
from one process for reasons that are not the lesson. The key projection has no bias: softmax
ignores a constant added to every score, so that bias's gradient is zero in exact arithmetic, and
AdamW (which divides by the gradient's size) would turn its rounding noise into full-size steps.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 14
    block_size: int = 8  # the longest sequence (positions)
    n_layer: int = 2
    n_head: int = 4  # divisible by 1, 2 and 4 ranks
    n_embd: int = 64  # width; the MLP is 4x wider (256)
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)  # see the module docstring
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, _ = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim); "heads" is whatever this rank holds
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the layers that add to the residual
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, idx):
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens, but block_size is {self.cfg.block_size}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def loss_fn(logits, targets):
    """Mean cross-entropy over the targets that count (-100 marks a position left out, e.g. the question)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
