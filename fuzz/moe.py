"""Mixture-of-experts blocks for the fuzzer (issue 26): a router (softmax and top-k, or top-k then
softmax; renormalised or not) and experts in the forms autopar recognises (docs/experts.md),
inside a residual: ``x + experts(x)``.

- ``stacked``: 3-D expert weights run by grouped matmuls, HF's ``grouped_mm_experts_forward``
  written out (transformers' ``grouped_mm_fallback`` op, which HF's models trace to on the CPU):
  ``layout`` "chunk" (Mixtral: ``gate_up_proj (E, 2F, d)``, gate | up in two halves), "interleave"
  (gpt-oss: ``(E, d, 2F)`` transposed, gate and up column by column, clamped), "plain" (one
  ``up_proj``, an activation, no gate); ``bias``: expert biases gathered by each row's expert;
- ``list``: a per-expert ``nn.ModuleList`` (w1, w3 | w2 linears, with or without biases) looped
  over with ``one_hot``, ``torch.where`` and ``index_add_``, as HF's MoE blocks did up to 4.4x.

Example:
    >>> MoE(8, {"kind": "moe", "experts": 4, "top_k": 2, "ffn": 6, "form": "stacked",
    ...         "layout": "chunk", "bias": False, "router": "softmax_topk", "renorm": True})
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTERS = ("softmax_topk", "topk_softmax")


def _grouped_mm(x, w, offs):
    """x (M, K) @ w (E, K, N) by groups of rows (``offs``: cumulative rows per expert)."""
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)


class StackedExperts(nn.Module):
    """experts(hidden (T, d), index (T, k), weights (T, k)) -> (T, d), over 3-D expert weights."""

    def __init__(self, d: int, ffn: int, experts: int, layout: str, bias: bool):
        import transformers.integrations.moe  # noqa: F401 - registers transformers::grouped_mm_fallback

        super().__init__()
        self.experts, self.layout = experts, layout
        width = ffn if layout == "plain" else 2 * ffn
        first = (experts, d, width) if layout == "interleave" else (experts, width, d)  # gpt-oss stores (in, out)
        down = (experts, ffn, d) if layout == "interleave" else (experts, d, ffn)
        self.gate_up_proj = nn.Parameter(torch.randn(*first) * d**-0.5)
        self.down_proj = nn.Parameter(torch.randn(*down) * ffn**-0.5)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(0.5 * torch.randn(experts, width))
            self.down_proj_bias = nn.Parameter(0.5 * torch.randn(experts, d))
        self.bias = bias

    def _linear(self, x, w, offs, ids, bias):
        out = _grouped_mm(x, w if self.layout == "interleave" else w.transpose(-2, -1), offs)
        return out + bias[ids] if self.bias else out

    def _gate(self, h):
        if self.layout == "chunk":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        if self.layout == "interleave":
            gate, up = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
            return (up + 1) * gate * torch.sigmoid(gate * 1.702)
        return F.gelu(h)

    def forward(self, hidden, index, weights):
        k, d = index.shape[-1], hidden.shape[-1]
        ids, perm = torch.sort(index.reshape(-1))
        rows = hidden[perm // k]
        w = weights.reshape(-1)[perm]
        counts = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = self._gate(self._linear(rows, self.gate_up_proj, offs, ids, getattr(self, "gate_up_proj_bias", None)))
        out = self._linear(h, self.down_proj, offs, ids, getattr(self, "down_proj_bias", None))
        out = out * w.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=perm.device)
        return out[inv].view(-1, k, d).sum(dim=1)


class Expert(nn.Module):
    """One expert of a ModuleList: Mixtral's w2(silu(w1(x)) * w3(x))."""

    def __init__(self, d: int, ffn: int, bias: bool):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, ffn, bias=bias), nn.Linear(d, ffn, bias=bias), nn.Linear(ffn, d, bias)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """x + the routed experts' weighted sum, token by token (the tokens: every position of x)."""

    def __init__(self, d: int, spec: dict):
        super().__init__()
        self.spec = spec
        e, ffn = spec["experts"], spec["ffn"]
        self.gate = nn.Linear(d, e, bias=False)
        if spec["form"] == "list":
            self.experts = nn.ModuleList([Expert(d, ffn, spec["bias"]) for _ in range(e)])
        else:
            self.experts = StackedExperts(d, ffn, e, spec["layout"], spec["bias"])

    def _route(self, h):
        logits = self.gate(h)
        if self.spec["router"] == "topk_softmax":  # gpt-oss
            top, index = torch.topk(logits, self.spec["top_k"], dim=-1)
            return index, top.softmax(dim=-1)
        weights, index = torch.topk(logits.softmax(dim=-1), self.spec["top_k"], dim=-1)
        if self.spec["renorm"]:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return index, weights

    def _loop(self, h, index, weights):
        """HF's per-expert loop over a ModuleList (transformers 4.4x)."""
        out = torch.zeros_like(h)
        mask = F.one_hot(index, num_classes=len(self.experts)).permute(2, 1, 0)
        for i in range(len(self.experts)):
            idx, top_x = torch.where(mask[i])
            rows = self.experts[i](h[None, top_x].reshape(-1, h.shape[-1])) * weights[top_x, idx, None]
            out.index_add_(0, top_x, rows.to(h.dtype))
        return out

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        index, weights = self._route(h)
        out = self._loop(h, index, weights) if self.spec["form"] == "list" else self.experts(h, index, weights)
        return x + out.reshape(x.shape)
