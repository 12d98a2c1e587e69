"""zero=3 on a model built on the meta device: every rank's module is emitted (shapes only)."""

from __future__ import annotations

import torch

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig


def test_zero3_rank_modules_of_a_meta_model():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    idx = torch.zeros(8, 8, dtype=torch.long, device="meta")
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(idx, idx), data_parallel=ap.DataParallel("dp", zero=3))
    for rank in (0, 1):
        module = plan.module(rank)
        assert all(p.is_meta for p in module.parameters())
        held = sum(p.numel() for p in module.parameters())
        assert 0 < held < sum(p.numel() for p in model.parameters())  # its zero=3 range only
