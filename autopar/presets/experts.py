"""Find the experts of MoE blocks in a traced model, for presets.megatron.

An experts module is the owner of the stacked 3-D weights (experts, in, out) that reach a
grouped expert matmul (``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``) as
its weight, directly or through transposes, casts and views.

Example:
    >>> expert_modules(model, traced)     # {'model.layers.0.mlp.experts': 8, ...}
"""

from __future__ import annotations

import torch

from autopar.sharding.expert_blocks import grouped_weight_modules


def expert_modules(model: torch.nn.Module, traced) -> dict[str, int]:
    """{module path: number of experts} for every module whose weights feed a grouped matmul."""
    modules = dict(model.named_modules())
    return {path: n for path, n in grouped_weight_modules(traced).items() if path in modules}
