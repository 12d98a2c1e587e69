"""The model traced again as it runs under a precision policy (parameters in another dtype).

A model's dtype casts are traced as constants: ``x.to(input_dtype)`` and ``x.float()`` both
become ``to(x, torch.float32)`` in an fp32 trace, metadata checks assert ``dtype=float32``,
``zeros(..., dtype=hidden.dtype)`` and ``torch.finfo(dtype).min`` are frozen. Run with bf16
parameters (``ap.DataParallel(param_dtype=...)``) such a graph crashes (HF Gemma2, Granite,
Phi3: the asserts; StableLM: an fp32 activation meets a bf16 weight) or computes in the wrong
dtype. Only the model's own code knows which casts follow its inputs: so it is traced once
more with parameters (and floating inputs) in the policy's dtype, on the meta device (no
memory: every parameter and buffer swapped for an empty meta tensor while it runs, the
originals put back after), and parallel/precision.py takes the constants from that trace.

Example:
    >>> low = trace_in_dtype(model, traced.example, torch.bfloat16, traced.opaque, dynamic=True, repeat_blocks=True)
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from autopar.trace.export import Traced, trace
from autopar.trace.opaque import keep_opaque


def skeleton(args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) with every tensor an empty meta tensor of its shape and dtype: what a
    trace needs of the example inputs (export runs on fake tensors; values are never read)."""

    def meta(v):
        return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v

    return pytree.tree_map(meta, (tuple(args), dict(kwargs or {})))


@contextlib.contextmanager
def meta_in_dtype(model: torch.nn.Module, dtype: torch.dtype):
    """Every parameter of ``model`` an empty meta Parameter of ``dtype`` (floating ones; tied
    parameters stay tied) and every buffer an empty meta tensor of its own dtype, while inside."""
    made: dict[int, torch.Tensor] = {}  # one stand-in per tensor: tied parameters stay tied
    saved = []
    for m in model.modules():
        for slots, is_param in ((m._parameters, True), (m._buffers, False)):
            for k, v in slots.items():
                if v is None:
                    continue
                if id(v) not in made:
                    low = dtype if is_param and v.is_floating_point() else v.dtype
                    empty = torch.empty(v.shape, dtype=low, device="meta")
                    made[id(v)] = torch.nn.Parameter(empty, v.requires_grad) if is_param else empty
                saved.append((slots, k, v))
    try:
        for slots, k, v in saved:
            slots[k] = made[id(v)]
        yield
    finally:
        for where, k, v in saved:
            where[k] = v


def trace_in_dtype(model, example: tuple, dtype: torch.dtype, opaque=(), dynamic=True, repeat_blocks=True) -> Traced:
    """``model`` traced with its parameters and floating inputs in ``dtype`` (see above)."""
    args, kwargs = pytree.tree_map(
        lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, example
    )
    with meta_in_dtype(model, dtype), keep_opaque(model, list(opaque), args, kwargs):
        return trace(model, args, kwargs, dynamic=dynamic, repeat_blocks=repeat_blocks)
