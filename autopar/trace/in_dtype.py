"""The model traced as it computes under a precision policy: parameters in the compute dtype.

A model's dtype casts are traced as constants: ``x.to(input_dtype)`` and ``x.float()`` both
become ``to(x, torch.float32)`` in an fp32 trace (a no-op there), metadata checks assert
``dtype=float32``, ``zeros(..., dtype=hidden.dtype)`` and ``torch.finfo(dtype).min`` are frozen.
HF's RMSNorm writes ``hidden_states.to(torch.float32)``: nothing in an fp32 trace, a real cast in
a bf16 one. So a plan under ``param_dtype=torch.bfloat16`` is made from one trace of the model
with its floating parameters (and floating example inputs) in bf16: every cast the model's own
code makes is in the graph as it runs in that dtype. The parameters are swapped for empty
stand-ins of their shapes on their own device while the model is exported (export reads shapes,
never values; an empty CPU tensor takes no resident memory), the originals put back after:
they stay the fp32 masters the rank modules and their optimizers hold.

Example:
    >>> with params_in_dtype(model, torch.bfloat16):
    ...     traced = trace(model, *inputs_in_dtype(args, kwargs, torch.bfloat16))
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree


def skeleton(args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) with every tensor an empty meta tensor of its shape and dtype: what a
    trace needs of the example inputs (export runs on fake tensors; values are never read)."""

    def meta(v):
        return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v

    return pytree.tree_map(meta, (tuple(args), dict(kwargs or {})))


def materialized(example: tuple, device) -> tuple:
    """``skeleton``'s (args, kwargs) as zeros on ``device`` (meta where ``device`` is None): inputs
    to trace the model again with (a plan under another precision policy, Plan.with_options)."""

    def real(v):
        if not isinstance(v, torch.Tensor) or device is None:
            return v
        return torch.zeros(v.shape, dtype=v.dtype, device=device).requires_grad_(v.requires_grad)

    return pytree.tree_map(real, example)


def inputs_in_dtype(args: tuple, kwargs: dict, dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """The example inputs as the policy's program gets them: floating tensors in ``dtype``
    (precision.cast_floating), integers (token ids) as they are."""
    if dtype is None:
        return args, kwargs

    def cast(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(dtype).requires_grad_(v.requires_grad)
        return v

    return pytree.tree_map(cast, (tuple(args), dict(kwargs or {})))


@contextlib.contextmanager
def params_in_dtype(model: torch.nn.Module, dtype: torch.dtype | None):
    """Every floating parameter of ``model`` an empty Parameter of ``dtype`` on its own device
    (tied parameters stay tied) while inside; buffers stay as they are (a policy casts parameters
    only, as FSDP2's MixedPrecisionPolicy does). ``dtype`` None: nothing changes."""
    if dtype is None:
        yield
        return
    made: dict[int, torch.Tensor] = {}  # one stand-in per tensor: tied parameters stay tied
    saved = []
    for m in model.modules():
        for k, v in m._parameters.items():
            if v is None or not v.is_floating_point() or v.dtype == dtype:
                continue
            if id(v) not in made:
                made[id(v)] = torch.nn.Parameter(torch.empty(v.shape, dtype=dtype, device=v.device), v.requires_grad)
            saved.append((m._parameters, k, v))
    try:
        for slots, k, v in saved:
            slots[k] = made[id(v)]
        yield
    finally:
        for slots, k, v in saved:
            slots[k] = v
