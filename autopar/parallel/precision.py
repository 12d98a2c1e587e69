"""The precision policy of data parallelism (``ap.DataParallel(param_dtype=, output_dtype=)``, any
zero level): compute with parameters and floating inputs cast to ``param_dtype`` from their
fp32 values, and hand the outputs back in ``output_dtype``. Written into the emitted program as
casts, so every rank, every mode and torch.compile see the same program.

Under zero=3 the gathers already cast the parameters they gather (parallel/fsdp_runtime.py); the
casts here cover the parameters no gather reads (all of them at zero 0-2; a weight tied across
pipeline stages or one left whole at zero=3).

Example:
    >>> dp = ap.DataParallel("dp", param_dtype=torch.bfloat16, output_dtype=torch.float32)
    >>> "cast_floating" in ap.plan(model, mesh, args=(x,), data_parallel=dp).module(0).code
    True
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.parallel.fsdp_runtime import fsdp_gather
from autopar.parallel.param_names import canonical_names


def cast_program(plan, graph: fx.Graph, param_dtype, output_dtype) -> None:
    """Write the policy's casts into ``graph`` (the one program every rank runs)."""
    if param_dtype is not None:
        gathered = lambda n: all(u.target is fsdp_gather for u in n.users)  # noqa: E731 - cast by the gather
        for node in [n for n in param_attrs(plan, graph) if not gathered(n)]:
            _cast_uses(graph, node, param_dtype, floating_only=False)
        for node in [n for n in graph.nodes if n.op == "placeholder"]:
            if node.meta.get("val") is None or node.meta["val"].dtype.is_floating_point:
                _cast_uses(graph, node, param_dtype, floating_only=True)
    if output_dtype is not None:
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            cast = graph.call_function(cast_outputs, (out.args[0], output_dtype))
        out.args = (cast,)


def param_attrs(plan, graph: fx.Graph) -> list[fx.Node]:
    """The program's reads of parameters (get_attr nodes that something uses)."""
    names = set(canonical_names(plan))
    return [n for n in graph.nodes if n.op == "get_attr" and n.target in names and n.users]


def _cast_uses(graph, node, dtype, floating_only: bool) -> None:
    with graph.inserting_after(node):
        cast = graph.call_function(cast_floating if floating_only else to_dtype, (node, dtype))
    node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)


def to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def cast_floating(x, dtype):
    """``x`` in ``dtype`` if it is a floating tensor (an input: token ids stay integers)."""
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def cast_outputs(outs, dtype):
    return pytree.tree_map(lambda v: cast_floating(v, dtype), outs)
