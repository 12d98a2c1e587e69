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

from dataclasses import dataclass, field

import sympy
import torch.fx as fx

from autopar.explore.formulas import PlanSymbols, simplify
from autopar.codegen.lowerings.vocab_cross_entropy import vocab_parallel_comms
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.propagate import layout_of, module_path
from autopar.sharding.redistribute import backward_bytes, plan_steps, step_bytes

BACKWARD_OF = {"all_gather": None, "all_reduce": None, "reduce_scatter": "all_gather",
               "all_to_all": "all_to_all", "slice": "all_gather", "to_partial": None, "partial_cast": None}


@dataclass(frozen=True)
class Comm:
    kind: str
    axis: str
    phase: str       # forward | backward | grad sync
    bytes: float     # per rank
    node: str
    module: str
    formula: sympy.Expr | None = field(default=None, compare=False)  # bytes in B, S, ..., dp, tp
    src: str = ""    # the value moved (a node name), "" for gradient buckets

    def __str__(self) -> str:
        where = f"{self.node} ({self.module})" if self.module else self.node
        return f"{self.kind} on {self.axis}, {self.phase}, {self.bytes:.0f} B, at {where}"


def _comm(sy: PlanSymbols, kind, axis, phase, formula, node, module, src="") -> Comm:
    formula = simplify(formula)
    return Comm(kind, axis, phase, sy.value(formula), node, module, formula, src)


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
            out.append(_comm(sy, st.kind, axis, "forward", step_bytes(st, local, n), *where, src.name))
        back = BACKWARD_OF[st.kind]
        if st.kind == "all_gather" and st.axis in f_axes:  # emitted as all_gather_rs
            f_axes.discard(st.axis)
            out.append(_comm(sy, "reduce_scatter", axis, "backward", (n - 1) * local, *where, src.name))
            back = None
        if back and layout_of(src).outputs and plan.ctx.needs_grad.get(src):
            out.append(_comm(sy, back, axis, "backward", backward_bytes(st, local, n), *where, src.name))
        cur[st.axis] = {"all_gather": Replicate(), "all_reduce": Replicate(), "reduce_scatter": Shard(st.dim or 0),
                        "slice": Shard(st.dim or 0), "all_to_all": Shard(st.dim2 or 0)}.get(
            st.kind, Partial(st.op.split("->")[-1]) if st.op else Replicate())
    for a in sorted(f_axes):
        n = sy.axes[a]
        local = sy.local_bytes(src, tuple(cur))
        out.append(_comm(sy, "all_reduce", mesh.axis_names[a], "backward", 2 * (n - 1) / n * local,
                         *where, src.name))


def collectives(plan, sy: PlanSymbols | None = None) -> list[Comm]:
    """Every collective of one training step on one rank, in graph order, then gradient buckets."""
    sy = sy or PlanSymbols.of(plan)
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
    out += _sync_comms(plan, sy)
    return out


def _lowering_comms(plan, node, sy) -> list[Comm]:
    """Collectives inside a lowering (they are not on an edge). The vocab-parallel loss, when
    present, also does the row count of a row split, so it is the only one counted."""
    lowerings = [(a, s.lowering) for a, s in enumerate(layout_of(node).strategies) if s is not None and s.lowering]
    names = plan.mesh.axis_names
    where = (node.name, module_path(node))
    vocab = [a for a, name in lowerings if name == "cross_entropy_vocab_parallel"]
    if vocab:
        return [_comm(sy, kind, names[a], phase, b, *where)
                for kind, a, phase, b in vocab_parallel_comms(plan, node, vocab[0], sy)]
    out = []
    for a, name in lowerings:
        if name == "cross_entropy_split_rows":  # one float32 count, all-reduced
            n = sy.axes[a]
            out.append(_comm(sy, "all_reduce", names[a], "forward", 2 * (n - 1) / n * 4, *where))
    return out


def _sync_comms(plan, sy) -> list[Comm]:
    """Gradient-sync collectives per step: per bucket and axis (ZeRO adds an all-gather per dp
    bucket after the step; local SGD has none on dp, its parameter average every k steps aside)."""
    mesh, dp = plan.mesh, plan.data_parallel
    params = dict(plan.model.named_parameters())
    out = []
    for i, b in enumerate(plan.grad_buckets()):
        numel = sum(sy.numel(params[n].shape, plan.param_specs.get(n)) for n in b.names)
        nbytes = numel * b.dtype.itemsize
        where = (f"bucket {i} ({len(b.names)} params)", _bucket_module(b.names))
        for a in b.axes:
            n, axis = sy.axes[a], mesh.axis_names[a]
            if a != plan.dp_axis or dp is None:
                out.append(_comm(sy, "all_reduce", axis, "grad sync", 2 * (n - 1) / n * nbytes, *where))
                continue
            if dp.local_sgd_every is not None:
                continue
            wire = numel * (dp.reduce_dtype.itemsize if dp.reduce_dtype is not None else b.dtype.itemsize)
            out += [_comm(sy, kind, axis, phase, f, *where) for kind, phase, f in dp_sync(dp.zero, n, wire, nbytes)]
    return out


def dp_sync(zero: int, n, wire, nbytes) -> list[tuple]:
    """(kind, phase, bytes per rank) of one bucket's sync on the data-parallel axis of size ``n``:
    ``wire`` bytes of gradient on the wire, ``nbytes`` of parameters (ZeRO all-gathers them)."""
    out = [("reduce_scatter", "grad sync", (n - 1) / n * wire) if zero == 2
           else ("all_reduce", "grad sync", 2 * (n - 1) / n * wire)]
    if zero:
        out.append(("all_gather", "optimizer", (n - 1) / n * nbytes))
    return out


def _bucket_module(names) -> str:
    """The longest module path the bucket's parameters share ('' for the whole model)."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)
