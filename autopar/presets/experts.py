"""Find the experts of MoE blocks in a traced model, for presets.megatron.

An experts module is the owner of the stacked 3-D weights (experts, in, out) that reach a
grouped expert matmul (``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``) as
its weight, directly or through transposes, casts and views.

Example:
    >>> expert_modules(model, traced)     # {'model.layers.0.mlp.experts': 8, ...}
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
GROUPED = {"aten::_grouped_mm", "transformers::grouped_mm_fallback"}
THROUGH = {
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.view.default,
    aten.reshape.default,
}


def _is_grouped(node: fx.Node) -> bool:
    return (
        node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.name() in GROUPED
    )


def expert_modules(model: torch.nn.Module, traced) -> dict[str, int]:
    """{module path: number of experts} for every module whose weights feed a grouped matmul."""
    modules = dict(model.named_modules())
    found: dict[str, int] = {}
    for node in traced.gm.graph.nodes:
        if not _is_grouped(node) or len(node.args) < 2:
            continue
        w = node.args[1]
        while isinstance(w, fx.Node) and w.op == "call_function" and w.target in THROUGH:
            w = w.args[0]
        fqn = traced.param_fqn.get(getattr(w, "name", None))
        if fqn is None:
            continue
        path = fqn.rpartition(".")[0]
        val = w.meta.get("val")
        if path in modules and isinstance(val, torch.Tensor) and val.dim() == 3:
            found[path] = int(val.shape[0])
    return found
