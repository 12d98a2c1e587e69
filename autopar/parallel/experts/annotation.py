"""``ap.expert_parallel(axis, tp=None)``: the layout annotation of a mixture-of-experts module.

It seeds the module's expert tensors split by expert on ``axis`` (``Shard(0)``; a part of two
merged data-parallel axes: ``Shard(0, within=k)`` / ``across=k``; a per-expert ModuleList's items
``Shard(0, of=(i, E))``) and records the module in ``seeds.experts`` (and ``seeds.expert_tp``),
which the collapse (blocks.py) reads. sharding/annotations.py's ``resolve`` calls ``seed`` with
its ``Site``, as for any annotation defined beside its technique. ``ap.ExpertParallel``
(technique.py) is the whole-model form: it gives this annotation to every experts module.

Example:
    >>> {"model.layers.*.mlp.experts": expert_parallel("dp", tp="tp")}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from autopar.errors import AnnotationError
from autopar.placement import Annotation, Replicate, Shard

R = Replicate()


@dataclass(frozen=True)
class expert_parallel(Annotation):
    """The experts of a mixture-of-experts module split on ``axis``: every parameter of the
    matched module whose dim 0 counts its experts (the 3-D expert weights, 2-D expert biases)
    is split on dim 0, so each rank holds E/n whole experts. Each rank runs the tokens routed
    to its experts; every token's expert outputs are summed over ``axis`` (a partial sum).
    presets.megatron finds such modules (the weights of grouped expert matmuls) by itself.
    On the axis that splits the batch, tokens are dispatched to their experts' ranks by
    all-to-all (docs/experts.md). ``tp``: each expert's matmuls also split over that axis
    (expert tensor parallelism: the first grouped matmul column-parallel, fused gate|up blocks
    kept whole per rank, the last row-parallel, the output a partial sum over ``tp``; a per-expert
    ModuleList's linears the same way). With the batch over two mesh axes
    (``DataParallel("b", replicate_axis="a")``), ``axis`` may be the inner one: the experts split
    within each group of b's ranks (``Shard(0, within=|b|)``), dispatched inside it, their
    gradients summed over ``a``; the outer one: split across those groups (``Shard(0,
    across=|b|)``), dispatched among the ranks of equal b, their gradients summed over ``b``; or
    ``("a", "b")``: over both.

    Example:
        >>> {"model.layers.*.mlp.experts": ap.expert_parallel("dp", tp="tp")}
        >>> {"model.layers.*.mlp.experts": ap.expert_parallel("b")}   # dp over ("a", "b")
        >>> {"model.layers.*.mlp.experts": ap.expert_parallel("a")}   # the same, experts over a
    """

    axis: str | tuple
    tp: str | None = None

    def __repr__(self) -> str:
        return f"expert_parallel({self.axis!r}" + (f", tp={self.tp!r})" if self.tp else ")")

    def seed(self, pattern: str, site, why: str) -> None:
        """The matched modules' expert tensors placed (sharding/annotations.py's ``resolve`` calls
        this with its ``Site``); ``seeds.experts`` / ``seeds.expert_tp`` record the modules."""
        _apply_experts(pattern, self, site, why)


def _expert_axis(ann, mesh) -> tuple[int, int, dict | None]:
    """(mesh axis, ranks the experts are split over, the Shard's part keyword) of ``ann.axis``: a
    mesh axis ({}), or one of two data-parallel axes merged into one (``DataParallel(axis,
    replicate_axis=)``): the inner one, the experts split within each group of its ranks and
    replicated across the groups (``within=k``); the outer one, split across the groups and
    replicated within each (``across=k``). A part of one rank: None, the experts whole on every rank
    (their tokens stay split: plain data parallelism); a part of every rank (the other axis has
    size 1): {}, split over the whole axis."""
    axis, sub = mesh.sub_axis(ann.axis)
    n = mesh.shape[axis] if sub is None else mesh.axis_size(sub)
    if sub is None or n == mesh.shape[axis]:
        return axis, n, {}
    key = "within" if sub.part == "inner" else "across"
    return axis, n, ({key: sub.within} if n > 1 else None)


def _expert_split(part: dict | None, **kw):
    """The placement of an expert tensor on the expert axis (``_expert_axis``' part)."""
    return R if part is None else Shard(0, **kw, **part)


def _apply_experts(pattern, ann, site, why):
    modules, mesh, put, seeds = site.modules, site.mesh, site.put, site.seeds
    axis, n, part = _expert_axis(ann, mesh)
    for path in site.match_modules(pattern):
        if isinstance(modules[path], nn.ModuleList):
            _apply_expert_list(path, ann, modules[path], mesh, put, why, seeds)
            continue
        own = dict(modules[path].named_parameters(recurse=False))
        counts = {p.shape[0] for p in own.values() if p.dim() == 3}
        if len(counts) != 1:
            raise AnnotationError(
                f"{ann!r} on module {path!r} ({type(modules[path]).__name__}): expected its own 3-D expert "
                f"weights (experts, in, out) with one expert count, found shapes "
                f"{[tuple(p.shape) for p in own.values()]}. Annotate the module holding the stacked expert weights."
            )
        experts = counts.pop()
        _seed_experts(path, ann, experts, n, axis, mesh, seeds)
        for pname, p in own.items():
            put(f"{path}.{pname}", axis, _expert_split(part) if p.dim() >= 2 and p.shape[0] == experts else R, why)


def _seed_experts(path: str, ann, count: int, n: int, axis: int, mesh, seeds) -> None:
    """Refuse ``count`` experts that do not divide over the axis' ``n`` ranks, else record the
    module's expert axis (and its expert tp axis: each expert's linears column- then row-parallel,
    tensor_parallel.py) in ``seeds``: stacked weights and per-expert lists alike."""
    if count % n:
        raise AnnotationError(
            f"{ann!r} on module {path!r}: {count} experts do not divide over the {n} ranks of axis "
            f"{ann.axis!r}" + (" (more ranks than experts)" if n > count else "") + ". Put the experts on an "
            f"axis whose size divides {count}, or use a smaller mesh axis."
        )
    seeds.experts[path] = axis
    if ann.tp is not None:
        seeds.expert_tp[path] = mesh.axis_index(ann.tp)


def _apply_expert_list(path, ann, experts: nn.ModuleList, mesh, put, why, seeds):
    """A per-expert ModuleList: expert i's tensors whole on the rank holding it (``Shard(0,
    of=(i, E))``: E/n experts per rank, under their own names), empty on the others."""
    (axis, n, part), count = _expert_axis(ann, mesh), len(experts)
    names = [sorted(name for name, _ in e.named_parameters()) for e in experts]
    if count < 2 or any(nm != names[0] for nm in names) or not names[0]:
        raise AnnotationError(
            f"{ann!r} on module {path!r} (a ModuleList of {count}): expected at least 2 expert modules with "
            f"the same parameters, found {[nm for nm in names[:3]]}. Annotate the list of the MoE block's experts."
        )
    _seed_experts(path, ann, count, n, axis, mesh, seeds)
    for i, expert in enumerate(experts):
        for pname, _ in expert.named_parameters():
            put(f"{path}.{i}.{pname}", axis, _expert_split(part, of=(i, count)), why)
