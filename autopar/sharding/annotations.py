"""Annotations: which layers are split how, keyed by fnmatch patterns.

Patterns match module paths (``"blocks.*.mlp.fc"``) for the layer annotations and parameter
or input names (``"wte.weight"``, ``"idx"``) for ``place``. Every pattern must match
something; every parameter ends up with one placement per mesh axis (replicated unless
annotated), and two annotations that disagree about one tensor are an error.

Example:
    >>> annotations = {"blocks.*.attn.qkv": colwise("tp"), "blocks.*.attn.proj": rowwise("tp"),
    ...                "pos_ids": place(Replicate(), Replicate())}
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from dataclasses import dataclass, field

import torch.nn as nn

from autopar.errors import AnnotationError, close_matches
from autopar.placement import Annotation, Placement, Replicate, Shard, check_layout, fmt_spec
from autopar.trace.model_members import named_modules, named_parameters

R = Replicate()


@dataclass(frozen=True)
class colwise(Annotation):
    """Column-parallel: a layer's output features split on ``axis`` (Megatron's ColumnParallelLinear).

    Linear weight rows and bias split, output sharded on its last dim. An Embedding splits
    its embedding dim. ``output`` asks for another output layout (e.g. Replicate() to gather).
    ``blocks=k`` is for fused layers whose output features are k equal blocks (GPT-2's
    ``c_attn``, q | k | v): each block is split, so every rank keeps whole heads of each.
    """

    axis: str
    output: Placement | None = None
    blocks: int = 1

    def __repr__(self) -> str:
        return f"colwise({self.axis!r}" + (f", blocks={self.blocks})" if self.blocks > 1 else ")")


@dataclass(frozen=True)
class rowwise(Annotation):
    """Row-parallel: a layer's input features split on ``axis`` (Megatron's RowParallelLinear).

    Linear weight columns split, bias replicated and added once after the reduction; the
    output is replicated (all-reduced) unless ``output`` says otherwise. On an Embedding this
    splits the vocabulary (masked lookup, partial results reduced).
    """

    axis: str
    output: Placement | None = R

    def __repr__(self) -> str:
        return f"rowwise({self.axis!r})"


@dataclass(frozen=True)
class replicated(Annotation):
    """Every parameter of the matched modules (or the matched parameters) replicated on every axis.

    (Spelled apart from the placement ``ap.Replicate()``: an annotation names what a layer is,
    like colwise and rowwise; a placement is one axis of a layout.)
    """

    def __repr__(self) -> str:
        return "replicated()"


def replicate() -> replicated:
    """Deprecated spelling of ap.replicated() (it differed from the placement ap.Replicate only by case)."""
    warnings.warn("ap.replicate() is deprecated: use ap.replicated().", DeprecationWarning, stacklevel=2)
    return replicated()


@dataclass(frozen=True)
class place(Annotation):
    """An explicit layout, one placement per mesh axis, for a parameter or an input by name."""

    placements: tuple

    def __init__(self, *placements: Placement):
        object.__setattr__(self, "placements", tuple(placements))

    def __repr__(self) -> str:
        return f"place{fmt_spec(self.placements)}"


@dataclass(frozen=True)
class vocab_parallel(Annotation):
    """The vocabulary split on ``axis``: an Embedding's rows (masked lookup, partial results
    reduced, output R unless ``output`` says otherwise, e.g. Shard(1) for sequence parallel)
    or an LM head's output features (logits stay split by class; a cross-entropy on them
    runs vocab-parallel and never gathers a full row).
    """

    axis: str
    output: Placement | None = R

    def __repr__(self) -> str:
        return f"vocab_parallel({self.axis!r})"


@dataclass(frozen=True)
class sequence_parallel(Annotation):
    """The matched modules (norms, dropouts) run on activations split on the sequence dim
    ``dim`` over ``axis``: their outputs are constrained to Shard(dim); their parameters stay
    replicated (their gradients, partial, are summed over ``axis`` by the gradient sync).
    Pair with rowwise(axis, output=Shard(dim)) and vocab_parallel(axis, output=Shard(dim))
    so that the residual stream stays split: presets.megatron(..., sequence_parallel=True).
    """

    axis: str
    dim: int = 1

    def __repr__(self) -> str:
        return f"sequence_parallel({self.axis!r})"


@dataclass
class Seeds:
    """What the annotations resolve to."""

    params: dict[str, tuple] = field(default_factory=dict)  # fqn -> placements
    inputs: dict[str, tuple] = field(default_factory=dict)  # input name -> placements
    module_outputs: dict[str, dict[int, Placement]] = field(default_factory=dict)  # path -> {axis: p}
    reasons: dict[str, str] = field(default_factory=dict)  # fqn / input / path -> why
    experts: dict[str, int] = field(default_factory=dict)  # path of an experts module split by expert -> mesh axis
    expert_tp: dict[str, int] = field(default_factory=dict)  # module path -> axis splitting each expert
    # mesh axis -> k: every dim split on the axis must cut into k x (axis size) equal chunks
    # (load-balanced context parallel's zig-zag order holds 2 chunks per rank)
    piece_multiple: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Site:
    """What an annotation defined outside this file (beside its technique in parallel/: the
    experts' split by expert) is given to seed itself: ``ann.seed(pattern, site, why)``. ``put(fqn,
    axis, placement, why)`` places one tensor on one mesh axis (two annotations that disagree are
    an error, as for the ones here); ``seeds`` takes what else it resolves to.

    Example:
        >>> for path in site.match_modules("layers.*.experts"):
        ...     site.put(f"{path}.w", 0, Shard(0), why)
    """

    modules: dict  # module path -> module
    paths: list  # module paths, the root's '' left out
    mesh: object
    put: object
    seeds: "Seeds"

    def match_modules(self, pattern: str) -> list[str]:
        """The module paths ``pattern`` matches (an AnnotationError naming the closest when none)."""
        return _matching(pattern, self.paths, "module path")


def _layer_kind(module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if type(module).__name__ == "Conv1D":  # HuggingFace GPT-2: weight is (in, out)
        return "conv1d"
    return "linear"


# (kind, annotation class) -> {param name: dim to split}
SPLITS = {
    ("linear", colwise): {"weight": 0, "bias": 0},
    ("linear", rowwise): {"weight": 1},
    ("conv1d", colwise): {"weight": 1, "bias": 0},
    ("conv1d", rowwise): {"weight": 0},
    ("embedding", colwise): {"weight": 1},
    ("embedding", rowwise): {"weight": 0},
    ("embedding", vocab_parallel): {"weight": 0},
    ("linear", vocab_parallel): {"weight": 0, "bias": 0},
    ("conv1d", vocab_parallel): {"weight": 1, "bias": 0},
}


def resolve(
    annotations: dict | None,
    model: nn.Module,
    mesh,
    input_names: list[str],
    data_parallel: str | None = None,
    input_ndims: dict | None = None,
) -> Seeds:
    """Turn ``{pattern: annotation}`` into placements for parameters and inputs."""
    seeds = Seeds()
    params = dict(named_parameters(model))
    modules = dict(named_modules(model))
    paths = [n for n in modules if n]  # module paths, the root's '' left out
    per_axis: dict[str, dict[int, tuple[Placement, str]]] = {}  # fqn -> axis -> (placement, why)

    def put(fqn: str, axis: int, p: Placement, why: str) -> None:
        prev = per_axis.setdefault(fqn, {}).get(axis)
        if prev is not None and prev[0] != p:
            raise AnnotationError(
                f"Conflicting annotations for {fqn!r} on axis {mesh.axis_names[axis]!r}: "
                f"{prev[1]} gives {prev[0]!r}, {why} gives {p!r}. Make the patterns disjoint."
            )
        per_axis[fqn][axis] = (p, why)

    for pattern, ann in (annotations or {}).items():
        if not isinstance(ann, Annotation):
            raise AnnotationError(
                f"Annotation for {pattern!r} is {ann!r}; use ap.colwise, ap.rowwise, ap.replicated or ap.place."
            )
        why = f"{ann!r} from pattern {pattern!r}"
        if isinstance(ann, place):
            _apply_place(pattern, ann, params, input_names, mesh, put, why)
        elif isinstance(ann, replicated):
            _apply_replicate(pattern, modules, params, mesh, put, why)
        elif isinstance(ann, sequence_parallel):
            for path in _matching(pattern, paths, "module path"):
                seeds.module_outputs.setdefault(path, {})[mesh.axis_index(ann.axis)] = Shard(ann.dim)
                seeds.reasons[path] = why
        elif callable(getattr(ann, "seed", None)):  # an annotation defined beside its technique seeds itself
            ann.seed(pattern, Site(modules, paths, mesh, put, seeds), why)
        else:
            _apply_layer(pattern, ann, modules, paths, mesh, put, why, seeds)

    for fqn, axes in per_axis.items():
        placements = tuple(axes.get(a, (R, ""))[0] for a in range(mesh.ndim))
        if fqn in params:
            check_layout(tuple(params[fqn].shape), placements, mesh, f"parameter {fqn!r}")
            seeds.params[fqn] = placements
        else:
            seeds.inputs[fqn] = placements
        seeds.reasons[fqn] = "; ".join(why for _, why in axes.values())
    if data_parallel is not None:
        data_parallel_inputs(seeds, mesh, data_parallel, input_names, input_ndims or {})
    return seeds


def _matching(pattern: str, names, what: str) -> list[str]:
    match = re.compile(fnmatch.translate(pattern)).match  # fnmatchcase's test, without its call per name
    hits = [n for n in names if match(n)]
    if not hits:
        raise AnnotationError(
            f"Annotation pattern {pattern!r} matches no {what}. Closest {what}s: {close_matches(pattern, names)}."
        )
    return hits


def _apply_place(pattern, ann, params, input_names, mesh, put, why):
    if len(ann.placements) != mesh.ndim:
        raise AnnotationError(
            f"{ann!r} for {pattern!r} gives {len(ann.placements)} placements but the "
            f"mesh {mesh} has {mesh.ndim} axes: give one per axis."
        )
    for name in _matching(pattern, list(params) + list(input_names), "parameter or input name"):
        for axis, p in enumerate(ann.placements):
            if p.is_partial():
                raise AnnotationError(f"{ann!r} for {name!r}: a parameter or input cannot start Partial.")
            put(name, axis, p, why)


def _apply_replicate(pattern, modules, params, mesh, put, why):
    names = [n for n in list(modules) + list(params) if n]
    for name in _matching(pattern, names, "module path or parameter name"):
        targets = [name] if name in params else [f"{name}.{p}" for p, _ in modules[name].named_parameters()]
        for fqn in targets:
            for axis in range(mesh.ndim):
                put(fqn, axis, R, why)


def _apply_layer(pattern, ann, modules, paths, mesh, put, why, seeds):
    axis = mesh.axis_index(ann.axis)
    for path in _matching(pattern, paths, "module path"):
        module = modules[path]
        kind = _layer_kind(module)
        split = SPLITS[(kind, type(ann))]
        own = dict(module.named_parameters(recurse=False))
        if "weight" not in own:
            raise AnnotationError(
                f"{ann!r} on module {path!r} ({type(module).__name__}): it has no 'weight' parameter "
                "to split. Annotate its Linear/Embedding submodules instead, e.g. "
                f"{path + '.*'!r}, or use ap.place on parameter names."
            )
        if own["weight"].dim() != 2:  # a norm's or a conv's weight: colwise/rowwise mean nothing there
            raise AnnotationError(
                f"{ann!r} on module {path!r} ({type(module).__name__}): its weight has shape "
                f"{tuple(own['weight'].shape)}, but {type(ann).__name__} splits the 2-D weight of a "
                "Linear or Embedding. Annotate a Linear/Embedding, or use ap.place on parameter names."
            )
        for pname, p in own.items():
            fqn = f"{path}.{pname}"
            dim = split.get(pname)
            blocks = getattr(ann, "blocks", 1) if isinstance(ann, colwise) else 1
            put(fqn, axis, Shard(dim, blocks) if dim is not None and dim < p.dim() else R, why)
        if isinstance(ann, vocab_parallel) and kind != "embedding":
            continue  # an LM head's logits stay split by class
        if ann.output is not None:
            seeds.module_outputs.setdefault(path, {})[axis] = ann.output
            seeds.reasons[path] = why


def data_parallel_inputs(seeds, mesh, axis_name, input_names, input_ndims):
    """Inputs split on dim 0 (the batch) over the data-parallel axis unless placed explicitly."""
    axis = mesh.axis_index(axis_name)
    for name in input_names:
        if input_ndims.get(name, 0) < 1:
            continue
        current = list(seeds.inputs.get(name, (R,) * mesh.ndim))
        if name in seeds.inputs and not current[axis].is_replicate():
            continue
        if name not in seeds.inputs:
            current[axis] = Shard(0)
            seeds.inputs[name] = tuple(current)
            seeds.reasons[name] = f"batch dim split on data-parallel axis {axis_name!r}"
