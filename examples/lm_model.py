"""A small LLaMA-style causal LM (RMSNorm, RoPE, SwiGLU, grouped-query attention) whose parameter
names, shapes and arithmetic are those of transformers' LlamaForCausalLM, so that the directory
ap.save_pretrained writes from it is loaded by ``LlamaForCausalLM.from_pretrained``.

It is written out here instead of using LlamaForCausalLM itself because autopar's pipeline runner
needs a model whose blocks sit in one ModuleList and whose output is the loss, and because
its forward is a few plain ops per layer (fast on CPU). ``llama_config`` makes the matching
LlamaConfig; tests/gloo/test_train_lm.py checks that both give the same logits.

Example:
    >>> cfg = llama_config(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, seq=64)
    >>> model = LlamaLM(cfg)
    >>> loss = model(idx, targets)              # model(idx): the logits
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig

import autopar as ap


def llama_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, seq: int) -> LlamaConfig:
    """The HF config of the model below (SwiGLU width 8/3 x hidden rounded up to 32, as LLaMA)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=32 * -(-(8 * hidden // 3) // 32),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        h, kv = cfg.num_attention_heads * self.head_dim, cfg.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(h, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        # -1 for the head count: tensor parallelism gives each rank its share of the heads
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # grouped-query attention: each key/value head serves n_rep query heads (HF's repeat_kv)
        k = k[:, :, None].expand(b, k.shape[1], self.n_rep, t, self.head_dim).reshape(b, -1, t, self.head_dim)
        v = v[:, :, None].expand(b, v.shape[1], self.n_rep, t, self.head_dim).reshape(b, -1, t, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """HF's LlamaModel: the names under ``model.``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaLM(nn.Module):
    """(idx, targets) -> the mean next-token cross-entropy; (idx,) -> logits. ``targets`` are the
    inputs shifted by one (the loader's), not HF's ``labels`` (shifted inside)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg  # ap.save_pretrained writes it as config.json
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        )
        angles = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        # not persistent: recomputed from the config, as HF does (not in checkpoints)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)  # LlamaConfig.initializer_range

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.model.embed_tokens(idx)
        # in the activations' dtype, as HF does (a bf16 policy computes q and k in bf16)
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        for block in self.model.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        # the loss alone when training: a rank module returns its outputs gathered over tp, and the
        # logits would cost an all-gather of batch x seq x vocab floats per step that nobody reads
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def megatron(tp: str = "tp") -> dict:
    """Megatron's tensor-parallel annotations: q/k/v and gate/up column-parallel (heads and SwiGLU
    columns split), o/down row-parallel (one all-reduce each per block, forward and backward), the
    embedding and the LM head split by vocabulary."""
    col, row = ap.colwise(tp), ap.rowwise(tp)
    return {
        "model.layers.*.self_attn.q_proj": col,
        "model.layers.*.self_attn.k_proj": col,
        "model.layers.*.self_attn.v_proj": col,
        "model.layers.*.self_attn.o_proj": row,
        "model.layers.*.mlp.gate_proj": col,
        "model.layers.*.mlp.up_proj": col,
        "model.layers.*.mlp.down_proj": row,
        "model.embed_tokens": ap.vocab_parallel(tp),  # vocabulary rows split, masked lookup
        "lm_head": ap.vocab_parallel(tp),  # logits split by vocabulary: the loss never gathers a row
    }
