"""A plan's parameters as the techniques see them: one name per tensor (tied weights share
one), each rank's local shapes, the ones a rank's modules hold, and the order backward
finishes their gradients. Pure readings of the plan, shared by the gradient buckets, ZeRO
and the fully sharded storage.

Example:
    >>> canonical_names(plan)["lm_head.weight"]        # 'wte.weight' when the head is tied
    >>> held_params(plan, rank=1)                       # meta tensors of rank 1's local shapes
"""

from __future__ import annotations

import torch

from autopar.placement import Replicate, local_shape
from autopar.trace.model_members import named_parameters


def canonical_names(plan) -> dict[str, str]:
    """Every parameter name -> the one name its tensor is stored under (tied weights share)."""
    out = {n: n for n, _ in plan.model.named_parameters(remove_duplicate=False)}
    for names in plan.traced.tied.values():
        out.update({n: names[0] for n in names})
    return out


def _first_uses(plan) -> list[tuple[int, str]]:
    """(position of the first node using it, parameter name) for every parameter the graph reads."""
    nodes = list(plan.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = []
    for node in nodes:
        fqn = plan.traced.param_fqn.get(node.name) if node.op == "placeholder" else None
        if fqn is not None:
            out.append((min((pos[u] for u in node.users), default=len(nodes)), fqn))
    return out


def first_use_order(plan) -> list[str]:
    """Canonical parameter names in the order of their first use in the forward graph."""
    canon, seen, order = canonical_names(plan), set(), []
    n_nodes = len(plan.graph.nodes)
    for _, fqn in sorted((p, f) for p, f in _first_uses(plan) if p < n_nodes):
        name = canon.get(fqn, fqn)
        if name not in seen:
            seen.add(name)
            order.append(name)
    return order


def param_order(plan) -> list[str]:
    """Parameter names in the order backward completes their gradients: the reverse of their
    first use in the forward graph (the same on every rank: it comes from the plan's graph)."""
    first = dict((f, p) for p, f in _first_uses(plan))
    for names in plan.traced.tied.values():  # a tied tensor: its first use under any of its names
        uses = [first[n] for n in names if n in first]
        first.update({n: min(uses) for n in names} if uses else {})
    return sorted(first, key=lambda n: -first[n])


def local_params(plan, rank: int = 0) -> dict[str, torch.Tensor]:
    """Meta tensors with this rank's local shapes (deduplicated names, as a module has them)."""
    out = {}
    for n, p in named_parameters(plan.model):
        spec = plan.param_specs.get(n, (Replicate(),) * plan.mesh.ndim)
        shape = local_shape(tuple(p.shape), spec, plan.mesh, plan.mesh.coords(rank))
        out[n] = torch.empty(shape, dtype=p.dtype, device="meta").requires_grad_(p.requires_grad)
    return out


def held_params(plan, rank: int = 0) -> dict[str, torch.Tensor]:
    """``local_params`` of the parameters ``rank``'s modules hold: all of them, or under a
    pipeline those its stages read (a weight tied across stages is held by each)."""
    params, lay = local_params(plan, rank), plan.stage_layout
    if lay is None:
        return params
    canon, pos = canonical_names(plan), plan.mesh.coords(rank)[lay.axis]
    read = {plan.attr_name(ph) for st in lay.stages if lay.rank_of_stage(st.index) == pos for ph in st.attrs}
    held = {canon.get(n, n) for n in read if n is not None}
    return {n: p for n, p in params.items() if canon.get(n, n) in held}


def stored_pieces(plan, rank: int) -> dict:
    """What ``rank`` stores of each parameter it holds (meta tensors): its compute piece, as the
    techniques store it (zero=3: its range of the flat bucket, which may hold a small parameter
    whole, in part or not at all)."""
    out = {}
    for name, local in held_params(plan, rank).items():
        for technique in plan.options.techniques:
            local = technique.stored(plan, rank, name, local)
        out[name] = local
    return out
