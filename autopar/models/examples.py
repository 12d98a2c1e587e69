"""Factories for the CLI and the notebooks: each returns (model, example_args).

Example:
    $ autopar plan autopar.models.examples:gpt --mesh dp=2,tp=2 --annotate 'blocks.*.mlp.fc=colwise:tp'
"""

from __future__ import annotations

import torch

from autopar.models.gpt import GPT, GPTConfig


def gpt(
    n_layer: int = 2,
    n_embd: int = 32,
    n_head: int = 4,
    vocab_size: int = 64,
    batch: int = 8,
    seq: int = 16,
    seed: int = 0,
):
    """A small GPT and a (tokens, targets) batch."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return model, (idx, targets)


def mlp(d: int = 16, hidden: int = 64, batch: int = 8, seed: int = 0):
    """A two-layer MLP (fc1 -> relu -> fc2) and an input batch."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(d, hidden))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("fc2", torch.nn.Linear(hidden, d))
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(seed + 1))
    return model, (x,)
