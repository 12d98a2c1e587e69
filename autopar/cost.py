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

from .gradsync import make_buckets
from .formulas import PlanSymbols, simplify
from .placement import Partial, Replicate, Shard, local_shape
from .propagate import layout_of, module_path
from .redistribute import backward_bytes, plan_steps, step_bytes

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
    for st in plan_steps(tuple(cur), target):
        local = sy.local_bytes(src, tuple(cur))
        n = sy.axes[st.axis]
        axis = mesh.axis_names[st.axis]
        if st.communicates:
            out.append(_comm(sy, st.kind, axis, "forward", step_bytes(st, local, n), *where, src.name))
        back = BACKWARD_OF[st.kind]
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
        for axis, s in enumerate(lay.strategies):
            if s is not None and s.lowering == "cross_entropy_split_rows":  # the float32 target count
                n = sy.axes[axis]
                out.append(_comm(sy, "all_reduce", plan.mesh.axis_names[axis], "forward",
                                 2 * (n - 1) / n * 4, node.name, module_path(node)))
    out_node = next(n for n in plan.graph.nodes if n.op == "output")
    for v in out_node.all_input_nodes:
        if "autopar" in v.meta and layout_of(v).outputs:
            key = (v, plan.output_target(layout_of(v).spec), frozenset())
            if key not in seen:
                seen.add(key)
                _edge_comms(plan, v, key[1], out_node, (), out, sy)
    out += _sync_comms(plan, sy)
    return out


def _sync_comms(plan, sy) -> list[Comm]:
    mesh = plan.mesh
    params = dict(plan.model.named_parameters())
    local_sizes = {}
    for n, p in params.items():
        spec = plan.param_specs.get(n)
        local_sizes[n] = p.new_empty(local_shape(tuple(p.shape), spec, mesh), device="meta").requires_grad_(
            p.requires_grad) if spec else p
    buckets = make_buckets(local_sizes, plan.grad_sync_axes, plan.options.get("bucket_bytes", 25 * 2**20),
                           plan.options.get("bucket_max_params"))
    out = []
    for i, b in enumerate(buckets):
        nbytes = sum(sy.numel(params[n].shape, plan.param_specs.get(n)) for n in b.names) * b.dtype.itemsize
        for a in b.axes:
            n = sy.axes[a]
            out.append(_comm(sy, "all_reduce", mesh.axis_names[a], "grad sync", 2 * (n - 1) / n * nbytes,
                             f"bucket {i} ({len(b.names)} params)", _bucket_module(b.names)))
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
