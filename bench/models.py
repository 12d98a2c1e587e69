"""The benchmarks' models, sizes and annotations (one place, so every contender gets the same).

Example:
    >>> model, args = build("gpt", "small", seed=0)
    >>> logits, loss = model(*args)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig


class MLPStack(nn.Module):
    """Residual MLP blocks (fc1 -> gelu -> fc2), a final LayerNorm, mean-square loss."""

    def __init__(self, d: int, hidden: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"fc1": nn.Linear(d, hidden), "fc2": nn.Linear(hidden, d)}) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)

    def forward(self, x, y):
        for layer in self.layers:
            x = x + layer["fc2"](F.gelu(layer["fc1"](x)))
        return F.mse_loss(self.norm(x), y)


# (hidden, mlp hidden, layers, heads, batch, seq): small is overhead-bound, large matmul-bound,
# 30m the ~30M-parameter LM of the data-parallel bench (d 512, 8 layers, sequence 128, 29.4M)
SIZES = {
    "small": (128, 512, 2, 4, 8, 64),
    "large": (512, 2048, 2, 8, 4, 64),
    "tiny": (32, 64, 1, 4, 2, 8),
    "30m": (512, 2048, 8, 8, 2, 128),
}
VOCAB = 512
VOCABS = {"30m": 8192}

GPT_TP = {
    "blocks.*.attn.qkv": ap.colwise("tp"),
    "blocks.*.attn.proj": ap.rowwise("tp"),
    "blocks.*.mlp.fc": ap.colwise("tp"),
    "blocks.*.mlp.proj": ap.rowwise("tp"),
}
MLP_TP = {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")}


def build(kind: str, size: str, seed: int = 0):
    """(serial model, example args) for ``kind`` in {"gpt", "mlp"} at ``size``."""
    d, hidden, layers, heads, batch, seq = SIZES[size]
    vocab = VOCABS.get(size, VOCAB)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "gpt":
        model = GPT(
            GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=d, mlp_ratio=hidden // d)
        )
        args = (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
    else:
        model = MLPStack(d, hidden, layers * 2)
        args = (torch.randn(batch, seq, d, generator=g), torch.randn(batch, seq, d, generator=g))
    return model, args


def annotations(kind: str) -> dict:
    return GPT_TP if kind == "gpt" else MLP_TP


def loss_of(out):
    """The scalar loss of a model's output (GPT returns (logits, loss))."""
    return out[1] if isinstance(out, (tuple, list)) else out
