"""The precision policy: compute in ``param_dtype`` over fp32 master parameters, reduce
gradients in ``reduce_dtype``, hand outputs back in ``output_dtype`` (FSDP2's
MixedPrecisionPolicy). Given as ``ap.DataParallel(param_dtype=, reduce_dtype=, output_dtype=)``
or, on any plan (tensor, pipeline or context parallel alone, or beside a DataParallel), as
``ap.plan(..., mixed_precision=ap.MixedPrecision(param_dtype=torch.bfloat16))``.

The plan is made in the compute dtype from the start: the model is traced once with its
parameters in ``param_dtype`` (trace/in_dtype.py), so every cast its own code makes (HF RMSNorm's
``hidden_states.to(torch.float32)``, ``softmax(dtype=float32)``, ``finfo(dtype).min`` masks) is in
the graph as it runs in that dtype. The rank modules keep the fp32 parameters (the masters the
optimizer steps, its state fp32 too); the program casts them to ``param_dtype`` where it reads
them: at the gather under zero=3 (parallel/data_parallel/fsdp_runtime.py), by a cast here otherwise (zero 0-2,
no data parallel, a weight tied across pipeline stages), but for the parameters a HuggingFace model
keeps in fp32 (``_keep_in_fp32_modules_strict``: trace/in_dtype.kept_in_fp32), read in fp32 as
traced. Autograd takes the gradient back through
the cast: it lands in fp32 on the master; the data-parallel sync reduces it in ``reduce_dtype``.
Floating inputs are cast to ``param_dtype``; the outputs to ``output_dtype``. Written into the
emitted program, so every rank, every mode and torch.compile see the same program.

Example:
    >>> dp = ap.DataParallel("dp", param_dtype=torch.bfloat16, output_dtype=torch.float32)
    >>> "cast_floating" in ap.plan(model, mesh, args=(x,), data_parallel=dp).module(0).code
    True
    >>> ap.plan(model, mesh, args=(x,), annotations=tp, mixed_precision=ap.MixedPrecision(torch.bfloat16))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.errors import DataParallelError
from autopar.parallel.data_parallel.fsdp_runtime import fsdp_gather
from autopar.parallel.param_names import canonical_names
from autopar.parallel.registry import register_technique
from autopar.parallel.technique import Technique

DTYPES = ("param_dtype", "reduce_dtype", "output_dtype")


@register_technique
@dataclass(frozen=True)
class MixedPrecision(Technique):
    """A precision policy on any plan (see the module's text). With a DataParallel beside it, its
    dtypes become the DataParallel's (which does the casts and the reductions); without one, the
    casts are this technique's, and gradients of parameters replicated over a split (a norm's
    weight under tensor parallelism) are summed in fp32 on the masters."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    name = "mixed_precision"
    order = 30  # after data parallel's gathers and the pipeline's stages: the casts read what they wrote

    def compute_dtype(self):
        return self.param_dtype

    def precision_policy(self):
        return self

    def __post_init__(self):
        for key in DTYPES:
            value = getattr(self, key)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise DataParallelError(f"MixedPrecision({key}={value!r}) must be a floating torch dtype or None.")

    @classmethod
    def fold(cls, chosen: dict) -> dict:
        """The techniques asked for with this policy's dtypes given to the DataParallel beside it
        (one place reads them: the gathers, the casts, the gradient sync); the same dtype given
        twice differently is refused."""
        mp, dp = chosen.get(cls.name), chosen.get("data_parallel")
        if mp is None or dp is None:
            return chosen
        both = {k: (getattr(mp, k), getattr(dp, k)) for k in DTYPES}
        clash = {k: v for k, v in both.items() if None not in v and v[0] != v[1]}
        if clash:
            raise DataParallelError(
                f"mixed_precision={mp} and data_parallel={dp} give different {', '.join(clash)}: give the "
                "precision policy once (ap.MixedPrecision, or DataParallel's own fields)."
            )
        dtypes = {k: mine if mine is not None else theirs for k, (mine, theirs) in both.items()}
        return {**chosen, "data_parallel": dataclasses.replace(dp, **dtypes)}

    def exact(self):
        return None  # plan.check compares the fp32 program with the serial model

    def rewrite_program(self, plan, graph) -> None:
        if plan.options.data_parallel is None:  # else data parallel casts, with its dtypes (fold)
            cast_program(plan, graph, self.param_dtype, self.output_dtype)

    def __str__(self) -> str:
        given = [f"{k}={getattr(self, k)}" for k in DTYPES if getattr(self, k) is not None]
        return f"MixedPrecision({', '.join(given)})"

    def fields(self) -> dict:
        return {k: None if getattr(self, k) is None else str(getattr(self, k)).removeprefix("torch.") for k in DTYPES}

    @classmethod
    def from_fields(cls, fields: dict) -> "MixedPrecision":
        return cls(**{k: None if v is None else getattr(torch, v) for k, v in fields.items()})


def cast_program(plan, graph: fx.Graph, param_dtype, output_dtype) -> None:
    """Write the policy's casts into ``graph`` (the one program every rank runs)."""
    if param_dtype is not None:
        gathered = lambda n: all(u.target is fsdp_gather for u in n.users)  # noqa: E731 - cast by the gather
        kept = plan.traced.kept_fp32  # HF's keep-in-fp32 modules: traced in fp32, read so
        for node in [n for n in param_attrs(plan, graph) if not gathered(n) and n.target not in kept]:
            _cast_uses(graph, node, param_dtype)
        for node in [n for n in graph.nodes if n.op == "placeholder"]:
            if node.meta.get("val") is None or node.meta["val"].dtype.is_floating_point:
                _cast_uses(graph, node, param_dtype)
    if output_dtype is not None:
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            cast = graph.call_function(cast_outputs, (out.args[0], output_dtype))
        out.args = (cast,)


def param_attrs(plan, graph: fx.Graph) -> list[fx.Node]:
    """The program's reads of parameters (get_attr nodes that something uses)."""
    names = set(canonical_names(plan))
    return [n for n in graph.nodes if n.op == "get_attr" and n.target in names and n.users]


def _cast_uses(graph, node, dtype) -> None:
    with graph.inserting_after(node):
        cast = graph.call_function(cast_floating, (node, dtype))
    node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)


def cast_floating(x, dtype):
    """``x`` in ``dtype`` if it is a floating tensor (an input: token ids stay integers; an
    integer parameter, which the policy's trace kept in its own dtype)."""
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def cast_outputs(outs, dtype):
    return pytree.tree_map(lambda v: cast_floating(v, dtype), outs)
