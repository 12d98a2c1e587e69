"""What a plan communicates per training step: every collective, with its bytes per rank.

Bytes are per rank, using ring algorithms (all-reduce 2(n-1)/n of the tensor, all-gather
(n-1)/n of the result, reduce-scatter and all-to-all (n-1)/n of the input). Each Comm carries
its bytes as a sympy ``formula`` in the named dims and mesh axis sizes (formulas.py);
``bytes`` is that formula at the example inputs' sizes. This is the one list of what runs:
the text table, plan.cost() and the plots all read it.

Example:
    >>> for c in plan.collectives(): print(c)
    Comm(all_reduce on tp, forward, 2048 B, at add_tensor_1 (blocks.0.attn.proj))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch.fx as fx

from autopar.cost.formulas import PlanSymbols, simplify
from autopar.sharding.lowerings.base import lowering_for
from autopar.sharding.propagate import layout_of
from autopar.trace.module_paths import module_path
from autopar.trace.model_members import named_parameters
from autopar.runtime.ring import ring_bytes
from autopar.sharding.redistribute import STEP_KINDS, backward_bytes, plan_steps, step_bytes


@dataclass(frozen=True)
class Comm:
    kind: str
    axis: str
    phase: str  # forward | backward | grad sync | recompute (a checkpointed block's, in backward)
    bytes: float  # per rank
    node: str
    module: str
    formula: sympy.Expr | None = field(default=None, compare=False)  # bytes in B, S, ..., dp, tp
    src: str = ""  # the value moved (a node name), "" for gradient buckets
    reason: str = field(default="", compare=False)  # why it runs, when its maker says (explain)

    def __str__(self) -> str:
        where = f"{self.node} ({self.module})" if self.module else self.node
        return f"{self.kind} on {self.axis}, {self.phase}, {self.bytes:.0f} B, at {where}"


def make_comm(sy: PlanSymbols, kind, axis, phase, formula, node, module, src="", reason="") -> Comm:
    formula = simplify(formula)
    return Comm(kind, axis, phase, sy.value(formula), node, module, formula, src, reason)


def _edge_comms(plan, src: fx.Node, target, consumer: fx.Node, f_axes, out, sy) -> None:
    mesh = plan.mesh
    cur = list(layout_of(src).spec)
    where = (consumer.name, module_path(consumer))
    f_axes = set(f_axes)
    for st in plan_steps(tuple(cur), target):
        local = sy.local_bytes(src, tuple(cur))
        n = sy.axes[st.axis]
        axis = mesh.axis_names[st.axis]
        if st.communicates:
            out.append(make_comm(sy, st.kind, axis, "forward", step_bytes(st, local, n), *where, src.name))
        back = STEP_KINDS[st.kind].backward
        if st.kind == "all_gather" and st.axis in f_axes:  # emitted as all_gather_rs
            f_axes.discard(st.axis)
            out.append(
                make_comm(
                    sy, "reduce_scatter", axis, "backward", ring_bytes("reduce_scatter", n * local, n), *where, src.name
                )
            )
            back = None
        if back and layout_of(src).outputs and plan.ctx.needs_grad.get(src):
            out.append(make_comm(sy, back, axis, "backward", backward_bytes(st, local, n), *where, src.name))
        cur[st.axis] = STEP_KINDS[st.kind].next_placement(st)
    for a in sorted(f_axes):
        n = sy.axes[a]
        local = sy.local_bytes(src, tuple(cur))
        out.append(
            make_comm(
                sy, "all_reduce", mesh.axis_names[a], "backward", ring_bytes("all_reduce", local, n), *where, src.name
            )
        )


def collectives(plan, sy: PlanSymbols | None = None, grad_sync: bool = True) -> list[Comm]:
    """Every collective of one training step on one rank, in graph order, then gradient buckets
    (left out with ``grad_sync=False``: the search counts the gradient sync per parameter and
    reads only the activations' collectives here; the buckets were most of this list's cost)."""
    sy = sy or PlanSymbols.of(plan)
    out = graph_collectives(plan, sy)
    if grad_sync:
        out += _sync_comms(plan, sy)
    for technique in plan.options.techniques:
        out += technique.collectives(plan, sy)
    return out


def graph_collectives(plan, sy: PlanSymbols) -> list[Comm]:
    """The collectives of the graph's edges and lowerings (forward and their backward), in graph
    order: what a technique that runs part of the graph again (checkpointing) repeats."""
    out: list[Comm] = []
    seen = set()
    for node in plan.graph.nodes:
        if "autopar" not in node.meta or node.op != "call_function":
            continue
        lay = layout_of(node)
        for i, (src, tgt) in enumerate(zip(lay.inputs, lay.input_targets)):
            f_axes = frozenset(plan.flow.f_edges.get((node.name, i), ()))
            key = (src, tgt, f_axes)
            if key in seen:
                continue
            seen.add(key)
            _edge_comms(plan, src, tgt, node, f_axes, out, sy)
        out += _lowering_comms(plan, node, sy)
    out_node = next(n for n in plan.graph.nodes if n.op == "output")
    for v in out_node.all_input_nodes:
        if "autopar" in v.meta and layout_of(v).outputs:
            key = (v, plan.output_target(layout_of(v).spec), frozenset())
            if key not in seen:
                seen.add(key)
                _edge_comms(plan, v, key[1], out_node, (), out, sy)
    return out


def _lowering_comms(plan, node, sy) -> list[Comm]:
    """Collectives inside a lowering (they are not on an edge): the lowering lists them."""
    found = lowering_for(layout_of(node).strategies)
    if found is None:
        return []
    lowering, axis = found
    where = (node.name, module_path(node))
    return [
        make_comm(sy, kind, plan.mesh.axis_label(a), phase, b, *where)
        for kind, a, phase, b in lowering.comms(plan, node, axis, sy)
    ]


def _sync_comms(plan, sy, rank: int | None = None, stored: dict | None = None) -> list[Comm]:
    """Gradient-sync collectives per step: per bucket and axis. On the data-parallel axis its
    options decide (ZeRO reduce-scatters and all-gathers after the step; local SGD has none).
    ``rank``: whose buckets (a pipeline rank's: its stages' parameters); ``stored``: the pieces it
    stores (``parallel.param_names.stored_pieces(plan, rank)``, passed in by the caller: cost sits below
    parallel) of a parameter zero=3 cuts (a range of a flat bucket: a small parameter whole
    on one rank, none on another); None: rank 0's buckets and an even share of each piece."""
    mesh, dp = plan.mesh, plan.state_storage
    params = dict(named_parameters(plan.model))
    out = []
    for i, b in enumerate(plan.grad_buckets(rank or 0, stored)):  # the rank's module buckets its stored pieces
        # a parameter stored in pieces (zero=3) is synced on the other axes as its stored piece
        numel = sum(
            stored[n].numel() if stored is not None and n in stored and _stored_share(plan, n) > 1
            else sy.numel(params[n].shape, plan.param_specs.get(n)) / _stored_share(plan, n)
            for n in b.names
        )  # fmt: skip
        where = (f"bucket {i} ({len(b.names)} params)", _bucket_module(b.names))
        folded = dp.group_axes(mesh, b.axes) if dp is not None else ()  # dp, or dp x cp (shard_axes)
        for a in b.axes:  # a SubAxis: replica groups of a tensor split on a part of an axis (Shard.within, across)
            n, axis = sy.axis(a), mesh.axis_label(a)
            if folded and a == folded[0]:  # one group over the folded axes, as the dp options say
                axis = mesh.axis_label(folded if len(folded) > 1 else a)
                out += [
                    make_comm(sy, kind, axis, phase, nbytes, *where)
                    for kind, phase, nbytes in dp.bucket_comms(numel, b.dtype, sy.axis(axis))
                ]
            elif a not in folded:
                out.append(
                    make_comm(
                        sy,
                        "all_reduce",
                        axis,
                        "grad sync",
                        ring_bytes("all_reduce", numel * b.dtype.itemsize, n),
                        *where,
                    )
                )
    return out


def _stored_share(plan, name: str) -> int:
    return math.prod(t.stored_share(plan, name) for t in plan.options.techniques)


def _bucket_module(names) -> str:
    """The longest module path the bucket's parameters share ('' for the whole model)."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)
