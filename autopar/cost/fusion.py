"""The bytes memory-bound ops move when torch.compile fuses them: regions read from the graph.

Eagerly every memory-bound op is its own kernel and reads and writes all of its tensors
(op_time.node_bytes). Inductor fuses connected pointwise ops, reductions and views into one
kernel, so a tensor made and used inside the kernel never reaches memory. This module groups the
plan's memory-bound ops (``op_work(node).kind == "elementwise"``, and views, which move nothing)
into fused regions: connected components of the graph, cut wherever a kernel inductor cannot fuse
sits or a boundary autopar keeps is crossed:

- matmuls, attention and expert matmuls (library kernels: cuBLAS, flash attention) are never in a
  region; their bytes stay op_time's;
- a redistribution between two ops (a collective runs there: the edge's producer spec is not the
  spec the consumer needs) cuts;
- a repeated block's boundary cuts (torchtitan compiles each TransformerBlock on its own,
  ``apply_compile``, and FSDP's per-block hooks run between them); so does the edge between an op
  a checkpointed region recomputes and one it does not (the recompute is its own graph).

Forward, a region reads each tensor it takes from outside once and writes each of its tensors
used outside it (or returned) once. Backward (its members needing a gradient), it reads the
gradients of those outputs, writes the gradients of its external inputs (accumulated in the
kernel: once), and reads the external inputs its backward needs: those the members save, and
those from which a saved tensor made inside the region is recomputed (AOTAutograd's min-cut
partitioner recomputes cheap fused pointwise ops instead of saving them). Each byte is charged to
the member that reads or writes it, so the weights of a short probe's blocks and the search's
components apply as before. What this leaves out is in docs/auto.md ("Compiled and Float8").

Example:
    >>> fwd, bwd = fused_bytes(plan, Numbers(plan.mesh))["mul_3"]   # the bytes charged to one op
    >>> [sorted(n.name for n in r) for r in fused_regions(plan)][:1]
"""

from __future__ import annotations

import torch

from autopar.cost.activation_memory import saved_activations
from autopar.sharding.propagate import layout_of
from autopar.sharding.rules import VIEW, op_traits
from autopar.trace.module_paths import module_paths

LIBRARY_KERNELS = ("matmul", "attention", "experts")  # never fused: their own kernels


def fusible(node) -> bool:
    """A call whose op inductor can fuse: a memory-bound op or a view with a tensor output."""
    if node.op != "call_function" or "autopar" not in node.meta or not layout_of(node).outputs:
        return False
    return op_traits(node.target).work.kind not in LIBRARY_KERNELS


def _block(node) -> str:
    """The repeated block ``node`` belongs to ('' outside any): the first numbered module path."""
    for path in module_paths(node):
        if path.rsplit(".", 1)[-1].isdigit():
            return path
    return ""


def _joined(producer, consumer, recomputed: set) -> bool:
    """Whether the edge producer -> consumer stays inside one fused kernel."""
    if _block(producer) != _block(consumer) or (producer.name in recomputed) != (consumer.name in recomputed):
        return False
    lay = layout_of(consumer)
    for i, target in zip(lay.inputs, lay.input_targets):
        if i is producer and layout_of(producer).spec != target:
            return False  # redistributed on the way: a collective between them
    return True


def fused_regions(plan, blocks_only: bool = False) -> list[list]:
    """The plan's fused regions (lists of graph nodes, graph order), by union-find over the
    edges ``_joined`` keeps between fusible nodes; ``blocks_only``: only the repeated blocks are
    compiled (torchtitan's ``apply_compile``), the ops outside them run eager."""
    recomputed = set().union(*(t.recomputed(plan) for t in plan.options.techniques))
    parent: dict = {}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    nodes = [n for n in plan.graph.nodes if fusible(n) and not (blocks_only and _block(n) == "")]
    for n in nodes:
        parent[n] = n
    for n in nodes:
        for i in n.all_input_nodes:
            if i in parent and _joined(i, n, recomputed):
                parent[root(i)] = root(n)
    regions: dict = {}
    for n in nodes:
        regions.setdefault(root(n), []).append(n)
    return list(regions.values())


def _tensor_bytes(node, spec, sy) -> float:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    return float(sy.numel(val.shape, spec)) * val.dtype.itemsize


def _is_view(node) -> bool:
    return op_traits(node.target).work is VIEW


def fused_bytes(plan, sy, needs_grad=None, blocks_only: bool = False) -> dict:
    """node name -> (forward, backward) bytes charged to that member of a fused region, for
    every node of ``plan`` in one (see the module docstring; ``blocks_only``: fused_regions');
    ``sy`` a Numbers of the mesh."""
    grads = plan.ctx.needs_grad if needs_grad is None else needs_grad
    saves = saved_activations(plan)
    saved_by: dict = {}  # consumer name -> producer names its backward keeps (itself for its own tensors)
    for s in saves:
        saved_by.setdefault(s.consumer, set()).add(s.producer or s.consumer)
    out = {}
    for region in fused_regions(plan, blocks_only):
        out.update(_region_bytes(region, sy, grads, saved_by))
    return out


def _region_bytes(region, sy, grads, saved_by) -> dict:
    members = set(region)
    charged = {n.name: [0.0, 0.0] for n in region}
    # views of outside tensors (through views only) are that memory: no kernel of theirs moves it
    through: set = set()
    for n in region:
        if _is_view(n) and all(i not in members or i in through for i in n.all_input_nodes):
            through.add(n)
    # the tensors the region's backward needs: kept by a member (from outside or made inside);
    # one made inside is recomputed from the outside tensors it comes from
    kept = set().union(*(saved_by.get(n.name, set()) for n in region))
    needed_from: set = set()
    for n in region:
        if n.name in kept and n not in through:
            needed_from |= _external_ancestors(n, members)
    read: set = set()
    for n in (m for m in region if m not in through):
        lay = layout_of(n)
        for i, target in zip(lay.inputs, lay.input_targets):
            if i in members and i not in through:
                continue
            for base, spec in _bases(i, target, members):
                if base in read:
                    continue
                read.add(base)
                b = _tensor_bytes(base, spec, sy)
                charged[n.name][0] += b  # read once, forward
                if not grads.get(n):
                    continue
                if base.name in kept or base in needed_from or (i in through and i.name in kept):
                    charged[n.name][1] += b  # read again by the backward
                if grads.get(base) and base.meta["val"].dtype.is_floating_point:
                    charged[n.name][1] += b  # its gradient, written once
        if any(u not in members or u in through for u in n.users):
            b = _tensor_bytes(n, layout_of(n).spec, sy)
            charged[n.name][0] += b  # written once
            if grads.get(n):
                charged[n.name][1] += b  # its gradient, read once
    return {k: (v[0], v[1]) for k, v in charged.items()}


def _bases(node, target, members) -> list:
    """(outside tensor, its spec) ``node`` reads: itself with the spec its consumer needs, or,
    for a view of outside tensors inside the region, the tensors it views."""
    if node not in members:
        return [(node, target)]
    outside = _external_ancestors(node, members)
    return [(i, layout_of(i).spec if "autopar" in i.meta else None) for i in outside]


def _external_ancestors(node, members) -> set:
    """The nodes outside ``members`` that ``node`` is computed from within the region."""
    out, todo, seen = set(), [node], set()
    while todo:
        n = todo.pop()
        for i in n.all_input_nodes:
            if i in seen:
                continue
            seen.add(i)
            if i in members:
                todo.append(i)
            else:
                out.add(i)
    return out
