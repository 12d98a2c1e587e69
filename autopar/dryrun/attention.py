"""Attention as a GPU runs it, in a dry run on the meta device.

``scaled_dot_product_attention`` picks its kernel by device: on CUDA, flash attention, which
keeps the output and one log-sum-exp per row for backward; on the meta device (the stand-in for
CUDA where torch has none, fake_world.py) the math path, which keeps the (B, H, S, S)
probabilities: 8.6 GB a layer at LLaMA-8B's 2 x 8192 tokens, most of a dry run's peak. Inside
``flash_attention_on_meta()`` an SDPA call on meta tensors without a mask runs torch's flash op
instead (its fake kernel needs no GPU; its backward and FLOP formulas are torch's), so the dry
run keeps what a GPU keeps. It is a kernel for the AutogradMeta key, registered for the block
only: a dispatch-level choice, the same in forward and in a checkpoint's recompute (a Python
mode is not, and selective checkpointing refuses a recompute whose ops differ). Grouped K/V
heads are repeated to the queries' first (what the op takes): their copies are counted too, a
little more than a GPU keeps.

Example:
    >>> with FakeTensorMode(), flash_attention_on_meta():
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # q on meta
"""

from __future__ import annotations

import contextlib

import torch


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:  # a mask: the efficient kernel on a GPU; the math path here
        math = torch.ops.aten._scaled_dot_product_attention_math.default
        return math(query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    if key.shape[-3] != query.shape[-3]:  # grouped K/V heads
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]


@contextlib.contextmanager
def flash_attention_on_meta():
    """SDPA on meta tensors runs flash attention in this block (the module docstring)."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - one kernel, for this block only
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradMeta")
    try:
        yield
    finally:
        lib._destroy()
