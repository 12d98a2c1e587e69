"""A PlanError for values computed from tensor data (``.item()``) that the plan would need.

torch.export keeps ``x.max().item()`` as an unbacked symbol (``zuf0``): fine while only
passed along, but planning must compare and hash the op's arguments, and a value known
only at run time cannot be. torch then raises ``GuardOnDataDependentSymNode`` from deep
inside; this names the node, the module and the source line instead, and says the way out.

Example:
    >>> h * h.detach().abs().max().item()     # in a model's forward
    ShardingError: node 'mul' (aten.mul.Tensor) in module 'mlp' uses a number computed from tensor data ...
"""

from __future__ import annotations

import torch.fx as fx

from autopar.errors import ShardingError

DATA_OPS = ("item", "_local_scalar_dense", "tolist")


def is_data_dependent_error(err: BaseException) -> bool:
    return type(err).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException")


def _sources(node: fx.Node) -> list[fx.Node]:
    """The .item()-like nodes this node's arguments come from (through symbolic arithmetic)."""
    seen, stack, found = set(), list(node.all_input_nodes), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if any(op in str(n.target) for op in DATA_OPS):
            found.append(n)
        elif n.op == "call_function" and not hasattr(n.meta.get("val"), "shape"):
            stack.extend(n.all_input_nodes)  # a SymFloat/SymInt computed from others
    return found


def _line(node: fx.Node) -> str:
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    return lines[-1].strip() if lines else "?"


def data_dependent_error(node: fx.Node, err: BaseException, module: str) -> ShardingError:
    src = _sources(node)
    where = f"in module {module!r}" if module else "at the model's top level"
    made = ", ".join(f"{s.name!r} at `{_line(s)}`" for s in src) or "a data-dependent value"
    return ShardingError(
        f"node {node.name!r} ({node.target}) {where} uses a number computed from tensor data "
        f"(made by {made}): its value is known only at run time, so autopar cannot plan the op "
        f"({type(err).__name__}). Keep it a tensor (e.g. h * h.abs().amax() instead of "
        f"h * h.abs().max().item()), or run the submodule whole and unplanned with "
        f"annotations={{{(module or 'path.to.submodule')!r}: ap.opaque()}}."
    )
