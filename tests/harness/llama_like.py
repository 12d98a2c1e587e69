"""A small LLaMA-style language model for context-parallel tests (no downloads).

RMSNorm, rotary positions from ``arange`` (or given position ids), grouped-query causal SDPA,
a SwiGLU MLP, an untied LM head, and HF's loss: labels shifted left by one, padded with -100;
``dropout`` > 0 adds dropout on the embeddings and on each MLP's output (none in attention).

    >>> model = llama_like()
    >>> logits, loss = model(*llama_batch())
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap

VOCAB = 64
# Megatron annotations of llama_like on a mesh axis "tp" (head-split attention, SwiGLU split on ffn)
TP = {
    "blocks.*.attn.[qkv]_proj": ap.colwise("tp"),
    "blocks.*.attn.o_proj": ap.rowwise("tp"),
    "blocks.*.gate": ap.colwise("tp"),
    "blocks.*.up": ap.colwise("tp"),
    "blocks.*.down": ap.rowwise("tp"),
}


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, causal: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.causal = heads, kv_heads, d // heads, causal
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin, mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        causal = self.causal and mask is None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p else nn.Identity()  # none traced at p = 0: the graphs other tests pin


class Block(nn.Module):
    def __init__(self, d, heads, kv_heads, causal, dropout=0.0):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.attn = Attention(d, heads, kv_heads, causal)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.drop = _dropout(dropout)

    def forward(self, x, cos, sin, mask=None):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        h = self.norm2(x)
        return x + self.drop(self.down(F.silu(self.gate(h)) * self.up(h)))


class LlamaLike(nn.Module):
    def __init__(
        self, d=32, heads=4, kv_heads=2, layers=2, causal=True, learned_positions=False, built_mask=False, dropout=0.0
    ):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(64, d) if learned_positions else None
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, causal, dropout) for _ in range(layers))
        self.drop = _dropout(dropout)  # dropout outside attention: on the embeddings and each MLP's output
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.hd = d // heads
        self.built_mask = built_mask  # the causal mask built here (HF's way) instead of is_causal

    def forward(self, input_ids, labels=None, mask=None):
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        freqs = pos[:, None].float() * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(input_ids)
        if self.built_mask and mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None, None]
        if self.pos is not None:
            x = x + self.pos(pos)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # HF's ForCausalLMLoss
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), shifted.reshape(-1), ignore_index=-100)
        return logits, loss


def llama_like(seed=0, **kw):
    torch.manual_seed(seed)
    return LlamaLike(**kw)


def llama_batch(batch=2, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g)
