"""A small LLaMA written as torchtitan writes its ``llama3`` model (no downloads).

What sets it apart from llama_like.py: the blocks live in an ``nn.ModuleDict`` keyed by layer
number (``self.layers[str(i)]``, iterated with ``.values()``), and attention is
``F.scaled_dot_product_attention(..., enable_gqa=True)`` followed by
``.transpose(1, 2).contiguous().view(bs, seqlen, -1)``, whose ``.contiguous()`` torch.export
drops (it is a no-op on the traced tensor).

    >>> model = titan_llama(kv_heads=1)
    >>> loss = model(*titan_batch())
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from tests.harness.llama_like import RMSNorm, rotate_half

VOCAB = 64
# torchtitan's parallelize_llama tensor-parallel plan, on a mesh axis "tp"
TP = {
    "layers.*.attention.w[qkv]": ap.colwise("tp"),
    "layers.*.attention.wo": ap.rowwise("tp"),
    "layers.*.feed_forward.w[13]": ap.colwise("tp"),
    "layers.*.feed_forward.w2": ap.rowwise("tp"),
}


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        xq = xq * cos + rotate_half(xq) * sin
        xk = xk * cos + rotate_half(xk) * sin
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=True)
        output = output.transpose(1, 2).contiguous()  # (bs, seqlen, n_heads, head_dim)
        return self.wo(output.view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, 2 * dim)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, n_layers=2):
        super().__init__()
        self.head_dim = dim // n_heads
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict()  # torchtitan's: pipeline stages delete keys and keep the rest's names
        for layer_id in range(n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, dim, n_heads, n_kv_heads)
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens, labels):
        seqlen = tokens.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        freqs = torch.arange(seqlen, device=tokens.device)[:, None].float() * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def titan_llama(seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(**kw)


def titan_batch(batch=2, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g)
