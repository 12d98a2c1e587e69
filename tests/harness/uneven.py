"""Models and batches at sizes that do not divide by the mesh (issue 24): an MLP whose hidden
size is 66 (17, 17, 16, 16 on tp=4), a GPT with an odd vocabulary (67: 34, 33 on tp=2).

    >>> plan = ap.plan(uneven_gpt(67), ap.Mesh((4,), ("tp",)), args=uneven_batch(67), annotations=MEGATRON | GPT_VOCAB)
"""

from __future__ import annotations

import torch

from autopar.models.gpt import GPT, GPTConfig

# the uneven meshes every uneven test runs on: (2,), (3,), (4,) and (2, 3)
UNEVEN_MESHES = (((2,), ("tp",)), ((3,), ("tp",)), ((4,), ("tp",)), ((2, 3), ("dp", "tp")))


def uneven_gpt(vocab: int = 67, seed: int = 0, layers: int = 2) -> GPT:
    """A tiny GPT (hidden 24, 4 heads) with ``vocab`` classes."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=layers, n_head=4, n_embd=24, tied=True))


def uneven_batch(vocab: int = 67, batch: int = 6, seq: int = 7, seed: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
