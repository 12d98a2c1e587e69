"""What a plan whose batch may be cut unevenly at run time cannot do, refused while planning.

A plan traced with a batch that does not divide by its axis is *ragged* on that axis
(propagate.is_ragged): any batch size runs, and no rank knows the sizes of the other ranks'
pieces. An all-gather of such a dim exchanges the sizes first (runtime/uneven.ragged_all_gather),
but a slice, a reduce-scatter or an all-to-all would have to cut it where the other tensors'
pieces were cut, which no rank knows; so those may not move a dim sized at run time across a
ragged axis, and ``rng="serial"`` cannot draw the serial model's numbers into a tensor split there (its piece
of one whole draw sits at an offset no rank knows). Both are found here from the layouts, so the
plan is refused with a ShardingError instead of failing later in emission.

Example:
    >>> check_ragged(graph, mesh, frozenset({0}), plan.output_target, serial_rng=False)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.errors import ShardingError
from autopar.placement import Shard
from autopar.sharding.propagate import layout_of, tensor_outputs
from autopar.sharding.redistribute import plan_steps
from autopar.sharding.rules import TensorMeta
from autopar.trace.module_paths import module_path


def check_ragged(graph: fx.Graph, mesh, ragged, output_target, serial_rng: bool) -> None:
    """Raise ShardingError where the layouts need what a ragged axis cannot give (module docstring)."""
    if not ragged:
        return
    for node in graph.nodes:
        lay = node.meta.get("autopar")
        if lay is None:
            continue
        for inp, target in zip(lay.inputs, lay.input_targets):
            _check_edge(inp, target, mesh, ragged, f"the input {inp.name!r} of node {node.name!r}")
        if serial_rng and lay.spec is not None and _draws(node):
            _check_draw(node, mesh, ragged)
    out = next(n for n in graph.nodes if n.op == "output")
    for v in torch.utils._pytree.tree_leaves(out.args[0]):
        if isinstance(v, fx.Node) and v.meta.get("autopar") is not None and layout_of(v).spec is not None:
            _check_edge(v, output_target(layout_of(v).spec), mesh, ragged, f"the output {v.name!r}")


def _dynamic(node: fx.Node) -> tuple:
    val = next((v for v in tensor_outputs(node) if v is not None), None)
    return TensorMeta.of(val).dynamic if val is not None else ()


def _check_edge(src: fx.Node, target, mesh, ragged, what: str) -> None:
    spec = layout_of(src).spec
    if spec is None or tuple(spec) == tuple(target):
        return
    dynamic = _dynamic(src)
    for st in plan_steps(spec, target):
        dims = [d for d in (st.dim, st.dim2) if d is not None and d < len(dynamic)]
        if st.kind == "all_gather" and st.blocks == 1:
            continue  # gathered with the pieces' sizes exchanged first (runtime/uneven.ragged_all_gather)
        if st.axis in ragged and any(dynamic[d] for d in dims):
            axis = mesh.axis_names[st.axis]
            raise ShardingError(
                f"{what} (module {module_path(src) or '<top>'!r}) needs its dim {st.dim} moved across mesh axis "
                f"{axis!r} ({st.kind}): that dim is sized at run time, and this plan lets it be cut unevenly on {axis!r} "
                f"(its example batch does not divide by {mesh.shape[st.axis]}), so no rank knows the other pieces' "
                f"sizes. Plan with an example batch that divides by {mesh.shape[st.axis]}, or keep it split on "
                f"{axis!r} (data parallel: data_parallel={axis!r} leaves outputs split on it)."
            )


def _draws(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _check_draw(node: fx.Node, mesh, ragged) -> None:
    dynamic = _dynamic(node)
    for axis, p in enumerate(layout_of(node).spec):
        if axis in ragged and isinstance(p, Shard) and p.dim < len(dynamic) and dynamic[p.dim]:
            raise ShardingError(
                f"node {node.name!r} ({node.target}, module {module_path(node) or '<top>'!r}) draws random numbers "
                f"into a tensor split on {mesh.axis_names[axis]!r} along a dim sized at run time, which this plan lets "
                "be cut unevenly: rng='serial' cannot place each rank's piece of the serial draw (no rank knows the "
                f"others' sizes). Use rng='placement', or plan with an example batch that divides by {mesh.shape[axis]}."
            )
