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

Parameters a HuggingFace model keeps in fp32 (``_keep_in_fp32_modules_strict`` under bf16 or fp16,
``_keep_in_fp32_modules`` under fp16 only, as ``from_pretrained(dtype=...)`` loads them:
Inkling2's router weight, which its code reads as ``F.linear(hidden.float(), weight)``) stay fp32
in the trace (``kept_in_fp32``): the policy's casts and zero=3's gathers leave them so.

Example:
    >>> with params_in_dtype(model, torch.bfloat16):
    ...     traced = trace(model, *inputs_in_dtype(args, kwargs, torch.bfloat16))
"""

from __future__ import annotations

import contextlib
import re

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


def kept_in_fp32(model: torch.nn.Module, dtype: torch.dtype | None) -> frozenset[str]:
    """Names (every alias of a tied one) of the floating fp32 parameters ``model`` keeps in fp32
    when it computes in ``dtype``: those a HuggingFace module declares in
    ``_keep_in_fp32_modules_strict`` (for bf16 and fp16) or ``_keep_in_fp32_modules`` (fp16 only),
    matched as transformers' loader matches them (a pattern, ``*`` any text, found anywhere in the
    parameter's name below the declaring module). Empty without a policy or a declaration.

    Example:
        >>> kept_in_fp32(inkling2, torch.bfloat16)
        frozenset({'model.layers.0.mlp.gate.weight', ...})
    """
    if dtype is None or dtype == torch.float32:
        return frozenset()
    ids = set()
    for prefix, m in model.named_modules():
        patterns = list(getattr(m, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            patterns += list(getattr(m, "_keep_in_fp32_modules", None) or ())
        if not patterns:
            continue
        found = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
        for name, p in m.named_parameters(remove_duplicate=False):
            if p.is_floating_point() and p.dtype == torch.float32 and found.search(name):
                ids.add(id(p))
    return frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids)


@contextlib.contextmanager
def params_in_dtype(model: torch.nn.Module, dtype: torch.dtype | None, keep: frozenset[str] = frozenset()):
    """Every floating parameter of ``model`` an empty Parameter of ``dtype`` on its own device
    (tied parameters stay tied) while inside, but those named in ``keep`` (``kept_in_fp32``);
    buffers stay as they are (a policy casts parameters only, as FSDP2's MixedPrecisionPolicy
    does). ``dtype`` None: nothing changes."""
    if dtype is None:
        yield
        return
    kept = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in keep}
    made: dict[int, torch.Tensor] = {}  # one stand-in per tensor: tied parameters stay tied
    saved = []
    for m in model.modules():
        for k, v in m._parameters.items():
            if v is None or not v.is_floating_point() or v.dtype == dtype or id(v) in kept:
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


def policy_params(model: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``model``'s parameters as a precision policy computes with them (the serial recipe, FSDP2's
    after its gather): ``dtype`` copies of the floating ones (autograd takes the gradient back to
    the fp32 master), those ``kept_in_fp32`` and integer ones as they are. ``dtype`` None: all as
    they are.

    Example:
        >>> loss = torch.func.functional_call(model, policy_params(model, torch.bfloat16), (), kw).loss
    """
    kept = kept_in_fp32(model, dtype)
    return {
        n: p.to(dtype) if dtype is not None and p.is_floating_point() and n not in kept else p
        for n, p in model.named_parameters()
    }
