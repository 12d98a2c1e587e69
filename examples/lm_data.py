"""The text train_lm.py learns from: the Python standard library's own sources, a byte-level BPE
tokenizer trained on them, and a loader that hands each data-parallel rank its rows of every
global batch and keeps its position for checkpoints.

The corpus is present wherever Python is: the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]`` (about 170 files, 4.7 MB on Python 3.11), in sorted order,
read up to ``max_mb``. Every 10th file is validation text, the rest training text (a file-level
split: no function is half in each). Documents are joined with ``<|endoftext|>``.

Example:
    >>> train, val = corpus_split(corpus_files(max_mb=4))
    >>> tok = load_or_train_tokenizer("runs/x/data/tokenizer.json", train, vocab_size=1024)
    >>> ids = encode(tok, train)                              # one int32 stream
    >>> loader = TokenLoader(ids, batch=16, seq=128, dp_rank=0, dp_size=2)
    >>> x, y = loader.next()                                  # this rank's 8 rows; y is x shifted by one
    >>> loader.state_dict()                                   # {"pos": 2048, "epoch": 0}
"""

from __future__ import annotations

import glob
import os
import sysconfig

import torch

EOT = "<|endoftext|>"
VALIDATION_EVERY = 10  # file i is validation text when i % 10 == 9


def corpus_files(max_mb: float) -> list[str]:
    """The standard library's top-level .py files in sorted order, up to ``max_mb`` megabytes."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    out, total = [], 0
    for f in files:
        size = os.path.getsize(f)
        if out and total + size > max_mb * 1e6:
            break
        out.append(f)
        total += size
    return out


def corpus_split(files: list[str]) -> tuple[list[str], list[str]]:
    """(training texts, validation texts): every 10th file is validation."""
    texts = [open(f, encoding="utf-8", errors="replace").read() for f in files]
    val = [t for i, t in enumerate(texts) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    train = [t for i, t in enumerate(texts) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    return train, val


def load_or_train_tokenizer(path: str, texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme: every byte is a token, so any text encodes) trained on
    ``texts``, or the one already saved at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if os.path.exists(path):
        return Tokenizer.from_file(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tok.save(path)
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    """The texts as one int32 token stream, each followed by the end-of-text token."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


class TokenLoader:
    """Global batches of ``batch`` rows of ``seq + 1`` consecutive tokens, read in order from the
    stream; this rank gets rows ``[dp_rank * batch / dp_size, (dp_rank + 1) * batch / dp_size)``
    (the rows autopar's ``plan.local_inputs`` gives its data-parallel coordinate). The position
    is global (tokens into the stream, and the epoch): a checkpoint resumes on any dp size."""

    def __init__(self, ids: torch.Tensor, batch: int, seq: int, dp_rank: int = 0, dp_size: int = 1):
        if batch % dp_size:
            raise ValueError(f"the batch of {batch} rows does not split over {dp_size} data-parallel ranks")
        if ids.numel() < batch * seq + 1:
            raise ValueError(f"the text has {ids.numel()} tokens, fewer than one batch ({batch} x {seq} + 1)")
        self.ids, self.batch, self.seq = ids, batch, seq
        self.rows = range(dp_rank * batch // dp_size, (dp_rank + 1) * batch // dp_size)
        self.pos, self.epoch = 0, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's rows, int64, shape (rows, seq); then advance."""
        span = self.batch * self.seq
        if self.pos + span + 1 > self.ids.numel():  # the end of the text: start the next epoch
            self.pos, self.epoch = 0, self.epoch + 1
        starts = [self.pos + r * self.seq for r in self.rows]
        rows = torch.stack([self.ids[s : s + self.seq + 1] for s in starts]).long()
        self.pos += span
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.epoch = int(state["pos"]), int(state["epoch"])
