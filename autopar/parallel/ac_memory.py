"""What activation checkpointing keeps, in the cost model's terms (cost/activation_memory.py):
the saved tensors of the ops outside the checkpointed blocks, each block's inputs, and under
a selective policy the outputs of the ops it keeps; plus the recompute's peak: while one block's
backward runs, the tensors its recompute made (the most any one block saves).

Example:
    >>> kept, peak = checkpointed_saves(plan, ap.ActivationCheckpoint("full"))
"""

from __future__ import annotations

import torch

from autopar.cost.activation_memory import DROPOUT_OPS, Saved, activation_bytes, base_of, saved_activations
from autopar.parallel.ac_regions import block_of
from autopar.runtime.rng import initial_state
from autopar.sharding.lowerings.random_draws import random_lowering
from autopar.sharding.propagate import layout_of


def checkpointed_saves(plan, technique) -> tuple[list[Saved], dict[str, list[Saved]]]:
    """(the saves kept through the step, per block the saves its recompute makes again)."""
    blocks = set(plan.built[technique.name])
    nodes = {n.name: n for n in plan.graph.nodes}
    keep_ops = technique.graph_save_ops() if technique.mode == "selective" else frozenset()
    kept, redone = [], {b: [] for b in blocks}
    for s in saved_activations(plan):
        block = block_of(nodes[s.consumer], blocks)
        if block is None:
            kept.append(s)
            continue
        inside = s.producer is not None and block_of(nodes[s.producer], blocks) == block
        if not inside and s.producer is not None:
            kept.append(s)  # the block's input: the checkpoint holds it
        elif nodes[s.producer or s.consumer].target in keep_ops:
            kept.append(s)  # a selective policy keeps this op's outputs
        else:
            redone[block].append(s)
    kept += _block_inputs(plan, blocks, nodes)
    # a selective policy stores every output of the ops it keeps, read by backward or not
    kept += [Saved(n.name, n.name, 0) for n in plan.graph.nodes if n.target in keep_ops and block_of(n, blocks)]
    if technique.mode == "selective":
        kept += _collective_outputs(plan, blocks)
    return kept, redone


def _collective_outputs(plan, blocks) -> list[Saved]:
    """The outputs of the collectives on a block's edges (kept by the selective policy): one per
    edge layout that communicates (all-reduce, all-gather, Megatron's f), at the input's size."""
    seen, out = set(), []
    f_edges = plan.flow.f_edges
    for node in plan.graph.nodes:
        if "autopar" not in node.meta or block_of(node, blocks) is None or not layout_of(node).outputs:
            continue
        lay = layout_of(node)
        for i, (inp, tgt) in enumerate(zip(lay.inputs, lay.input_targets)):
            moved = "autopar" in inp.meta and layout_of(inp).spec != tgt
            if (moved or (node.name, i) in f_edges) and (inp.name, tgt) not in seen:
                seen.add((inp.name, tgt))
                out.append(Saved(f"{node.name}:{i}", inp.name, -1))
    return out


def _block_inputs(plan, blocks, nodes) -> list[Saved]:
    """Tensors made outside a block and read inside it (the checkpoint keeps them, whether they
    need a gradient or not: rotary tables, masks), each as the storage it views."""
    out = []
    for node in plan.graph.nodes:
        block = block_of(node, blocks)
        if block is None or node.op != "call_function":
            continue
        for a in node.all_input_nodes:
            if block_of(a, blocks) == block or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            base, idx = base_of(a)
            if base.op == "call_function":
                out.append(Saved(node.name, base.name, idx))
    return out


def checkpointed_terms(plan, technique, sy, terms: dict) -> dict:
    """plan.cost()'s ``activations`` under checkpointing and ``recompute`` (its peak). A block that
    draws random numbers also keeps a copy of the generator state until its backward (the
    recompute starts from it: runtime/recompute.Region), a CPU generator's state in bytes."""
    kept, redone = checkpointed_saves(plan, technique)
    peaks = [activation_bytes(plan, sy, saves, with_outputs=False) for saves in redone.values() if saves]
    peak = max(peaks, key=sy.value) if peaks else 0
    blocks = set(plan.built[technique.name])
    drawing = {block_of(n, blocks) for n in plan.graph.nodes if n.op == "call_function" and _draws(n)} - {None}
    snapshots = len(drawing) * initial_state(0).numel()
    return dict(terms, activations=activation_bytes(plan, sy, kept) + snapshots, recompute=peak)


def _draws(node) -> bool:
    return node.target in DROPOUT_OPS or random_lowering(node.target) is not None
