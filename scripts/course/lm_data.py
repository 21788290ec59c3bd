"""Data for the small GPT (notebooks 10-12): written arithmetic the course generates, or a folder of text.

    from course.lm_data import load_lm_data
    data = load_lm_data()                    # "37+45=082": 2-digit sums, 9,000 train / 1,000 validation
    data = load_lm_data("path/to/texts")     # every *.txt under the folder, character-level
    x, y = data.batch("train", step, 64, seed=0)   # (64, T) inputs and next-token targets
    data.accuracy(logits, y)                 # exact answers: every counted target right
    load_lm_data(..., batch_size=64)         # DataError (naming the flag) if a batch cannot be drawn

Arithmetic: each sample is ``a+b=ccc`` (a, b in 0..99, the sum written with 3 digits), all 10,000 pairs
shuffled once with a fixed seed, the last 1,000 held out. The model reads the question and predicts the
next character; only the 3 answer digits count in the loss (the other targets are -100, ignored), and a
sample is right when all 3 are. Greedy decoding gives the same answer as long as every digit before it
is right, so this teacher-forced accuracy equals the exact-answer accuracy of generated answers.

Text: the characters of all files form the vocabulary; samples are windows of ``block_size + 1``
characters at fixed positions (90 % train, 10 % validation); every target counts, accuracy is the
fraction of characters predicted right.

Batches are a pure function of (split, step, batch size, seed): two processes that ask for the same
step get the same samples, with no sampler to keep in step. Nothing here downloads anything.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100  # a target left out of the loss (F.cross_entropy's default ignore_index)
DIGITS = 2
ARITH_CHARS = "0123456789+="  # 12 tokens: divisible by 2 and 4 ranks, as a vocabulary-split head needs
MULTIPLE = 8  # a text vocabulary is padded with unused tokens to a multiple of this


class DataError(ValueError):
    """Data that cannot be used as asked; ``flag`` names the command-line flag to change (a script reports
    ``argument <flag>: <message>`` in one line)."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


@dataclass
class LMData:
    name: str  # "arithmetic" or the text folder
    vocab: list[str]  # token id -> character
    train: torch.Tensor  # (N, T + 1) int64: inputs are [:, :-1], targets [:, 1:]
    val: torch.Tensor
    counted: torch.Tensor  # (T,) bool: which target positions count in loss and accuracy

    @property
    def block_size(self) -> int:
        return self.train.shape[1] - 1

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)  # c: one character

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def _split(self, rows: torch.Tensor):
        x, y = rows[:, :-1].clone(), rows[:, 1:].clone()
        y[:, ~self.counted] = IGNORE
        return x, y

    def batch(self, split: str, step: int, batch_size: int, seed: int = 0):
        """Batch number ``step`` of an endless stream: a new permutation of the split every epoch."""
        rows = self.train if split == "train" else self.val
        per_epoch = len(rows) // batch_size
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        return self._split(rows[order[i * batch_size:(i + 1) * batch_size]])

    def split(self, split: str, limit: int | None = None):
        """The whole split (or its first ``limit`` rows), in order: for evaluation."""
        rows = self.train if split == "train" else self.val
        return self._split(rows[:limit])

    @staticmethod
    def accuracy(logits, targets) -> tuple[int, int]:
        """(right, total): samples whose every counted target is the argmax of its logits."""
        counted = targets != IGNORE
        right = ((logits.argmax(-1) == targets) | ~counted).all(dim=1)
        return int(right.sum()), len(targets)


def arithmetic(digits: int = DIGITS, val_size: int = 1000, seed: int = 1234) -> LMData:
    """Every pair a + b with ``digits``-digit operands, as ``a+b=sum`` with the sum padded to digits+1."""
    n = 10 ** digits
    vocab = list(ARITH_CHARS)
    texts = [f"{a:0{digits}d}+{b:0{digits}d}={a + b:0{digits + 1}d}" for a in range(n) for b in range(n)]
    rows = torch.tensor([[vocab.index(c) for c in t] for t in texts], dtype=torch.long)
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]
    answer_from = 2 * digits + 1  # the '=': the target after it is the first answer digit
    counted = torch.arange(rows.shape[1] - 1) >= answer_from
    return LMData("arithmetic", vocab, rows[:-val_size], rows[-val_size:], counted)


def text_folder(folder: str | Path, block_size: int = 64, max_samples: int = 20_000) -> LMData:
    """Character-level windows from every *.txt file under ``folder`` (sorted, joined by newlines); the
    vocabulary is padded with unused ids to a multiple of 8, so that 2, 4 or 8 ranks can split the head."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError("--data-dir", f"{folder} is {'a file' if folder.exists() else 'missing'}, not a folder")
    files = sorted(folder.rglob("*.txt"))
    if not files:
        raise DataError("--data-dir", f"no *.txt files under {folder}")
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if len(text) < 2 * (block_size + 1):
        raise DataError("--block-size", f"{block_size}: the {len(text)} characters under {folder} are too few "
                        f"for windows of {block_size} + 1 (they need at least twice that)")
    vocab = sorted(set(text))
    vocab += [""] * (-len(vocab) % MULTIPLE)  # unused ids, so that 2, 4 or 8 ranks can split the head
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    starts = torch.linspace(0, len(ids) - block_size - 1, min(max_samples, len(ids) - block_size)).long()
    rows = torch.stack([ids[s:s + block_size + 1] for s in starts.tolist()])
    cut = int(len(rows) * 0.9)  # the last 10 % of the text is held out (windows of it overlap nothing earlier)
    counted = torch.ones(block_size, dtype=torch.bool)
    return LMData(str(folder), vocab, rows[:cut], rows[cut:], counted)


def load_lm_data(data_dir: str | Path | None = None, block_size: int = 64, batch_size: int | None = None) -> LMData:
    """The generated arithmetic, or the text under ``data_dir`` (``block_size`` applies to text only).
    With ``batch_size``: DataError unless a batch of that many training samples can be drawn."""
    data = arithmetic() if data_dir is None else text_folder(data_dir, block_size)
    if batch_size is not None and not 1 <= batch_size <= len(data.train):
        raise DataError("--batch-size", f"{batch_size}: a batch is drawn from the {len(data.train):,} training "
                        f"samples of {data.name}, so it takes 1 to {len(data.train):,} of them")
    return data
