"""What a plan communicates per training step: every collective, with its bytes per rank.

Bytes are for the example inputs' sizes, per rank, using ring algorithms
(all-reduce 2(n-1)/n of the tensor, all-gather (n-1)/n of the result, reduce-scatter and
all-to-all (n-1)/n of the input).

Example:
    >>> for c in plan.collectives(): print(c)
    Comm(all_reduce on tp, forward, 2048 B, at add_tensor_1 (blocks.0.attn.proj))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .gradsync import make_buckets
from .lowering_vocab import vocab_parallel_comms
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

    def __str__(self) -> str:
        where = f"{self.node} ({self.module})" if self.module else self.node
        return f"{self.kind} on {self.axis}, {self.phase}, {self.bytes:.0f} B, at {where}"


def _nbytes(node: fx.Node, spec, mesh) -> float:
    val = node.meta["val"]
    shape = [int(s.node.hint) if hasattr(s, "node") else int(s) for s in val.shape]
    n = 1
    for s in local_shape(shape, spec, mesh):
        n *= s
    return float(n * val.dtype.itemsize)


def _edge_comms(plan, src: fx.Node, target, consumer: fx.Node, f_axes, out) -> None:
    mesh = plan.mesh
    cur = list(layout_of(src).spec)
    f_axes = set(f_axes)
    for st in plan_steps(tuple(cur), target):
        local = _nbytes(src, tuple(cur), mesh)
        n = mesh.shape[st.axis]
        axis = mesh.axis_names[st.axis]
        if st.communicates:
            out.append(Comm(st.kind, axis, "forward", step_bytes(st, local, n), consumer.name, module_path(consumer)))
        back = BACKWARD_OF[st.kind]
        if st.kind == "all_gather" and st.axis in f_axes:  # emitted as all_gather_rs
            f_axes.discard(st.axis)
            out.append(Comm("reduce_scatter", axis, "backward", (n - 1) * local, consumer.name,
                            module_path(consumer)))
            back = None
        if back and layout_of(src).outputs and plan.ctx.needs_grad.get(src):
            out.append(Comm(back, axis, "backward", backward_bytes(st, local, n), consumer.name,
                            module_path(consumer)))
        cur[st.axis] = {"all_gather": Replicate(), "all_reduce": Replicate(), "reduce_scatter": Shard(st.dim or 0),
                        "slice": Shard(st.dim or 0), "all_to_all": Shard(st.dim2 or 0)}.get(
            st.kind, Partial(st.op.split("->")[-1]) if st.op else Replicate())
    for a in sorted(f_axes):
        n = mesh.shape[a]
        local = _nbytes(src, tuple(cur), mesh)
        out.append(Comm("all_reduce", mesh.axis_names[a], "backward", 2 * (n - 1) / n * local,
                        consumer.name, module_path(consumer)))


def collectives(plan) -> list[Comm]:
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
            _edge_comms(plan, src, tgt, node, f_axes, out)
        out += _lowering_comms(plan, node)
    out_node = next(n for n in plan.graph.nodes if n.op == "output")
    for v in out_node.all_input_nodes:
        if "autopar" in v.meta and layout_of(v).outputs:
            key = (v, plan.output_target(layout_of(v).spec), frozenset())
            if key not in seen:
                seen.add(key)
                _edge_comms(plan, v, key[1], out_node, (), out)
    out += _sync_comms(plan)
    return out


def _lowering_comms(plan, node) -> list[Comm]:
    """Collectives inside a lowering (they are not on an edge). The vocab-parallel loss, when
    present, also does the row count of a row split, so it is the only one counted."""
    lowerings = [(a, s.lowering) for a, s in enumerate(layout_of(node).strategies) if s is not None and s.lowering]
    names = plan.mesh.axis_names
    vocab = [a for a, name in lowerings if name == "cross_entropy_vocab_parallel"]
    if vocab:
        return [Comm(kind, names[a], phase, b, node.name, module_path(node))
                for kind, a, phase, b in vocab_parallel_comms(plan, node, vocab[0])]
    out = []
    for a, name in lowerings:
        if name == "cross_entropy_split_rows":  # one float32 count, all-reduced
            n = plan.mesh.shape[a]
            out.append(Comm("all_reduce", names[a], "forward", 2 * (n - 1) / n * 4, node.name, module_path(node)))
    return out


def _sync_comms(plan) -> list[Comm]:
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
        nbytes = b.numel * b.dtype.itemsize
        for a in b.axes:
            n = mesh.shape[a]
            out.append(Comm("all_reduce", mesh.axis_names[a], "grad sync", 2 * (n - 1) / n * nbytes,
                            f"bucket {i} ({len(b.names)} params)", ""))
    return out
