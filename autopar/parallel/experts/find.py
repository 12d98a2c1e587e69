"""Find the experts of MoE blocks in a traced model (for ap.ExpertParallel, presets.megatron and the search).

An experts module is the owner of the stacked 3-D weights (experts, in, out) that reach a
grouped expert matmul (``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``) as
its weight, directly or through transposes, casts and views; or a per-expert ``ModuleList``
of identical modules run on the rows routed to each (lists.py).

Example:
    >>> expert_modules(model, traced)     # {'model.layers.0.mlp.experts': 8, ...}
"""

from __future__ import annotations

import torch

from autopar.parallel.experts.blocks import grouped_weight_modules
from autopar.parallel.experts.lists import list_expert_modules


def expert_modules(model: torch.nn.Module, traced) -> dict[str, int]:
    """{module path: number of experts} for every module whose weights feed a grouped matmul
    and every per-expert ModuleList."""
    modules = dict(model.named_modules())
    found = {**grouped_weight_modules(traced), **list_expert_modules(traced)}
    return {path: n for path, n in found.items() if path in modules}
