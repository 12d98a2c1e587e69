"""What activation checkpointing keeps, in the cost model's terms (cost/activation_memory.py):
the saved tensors of the ops outside the checkpointed blocks, each block's inputs, and under
a selective policy the outputs of the ops it keeps; plus the recompute's peak: while one block's
backward runs, the tensors its recompute made, less what the backwards before it freed. Under
``offload=True`` a block's activation inputs and what its policy keeps are host bytes
(``offloaded``), back on the device only during that block's backward.

Example:
    >>> kept, redone, host = checkpointed_saves(plan, ap.ActivationCheckpoint("full", offload=True))
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.cost.activation_memory import (
    Saved,
    activation_bytes,
    base_of,
    draws_random,
    saved_activations,
)
from autopar.parallel.activation_checkpoint.regions import block_of
from autopar.runtime.rng import initial_state
from autopar.sharding.propagate import layout_of


def checkpointed_saves(plan, technique) -> tuple[list[Saved], dict[str, list[Saved]], list[Saved]]:
    """(the saves kept on the device through the step, per block the saves its recompute makes
    again, the saves kept in host memory: under ``offload``, each block's activation inputs and
    what its selective policy keeps; empty without it). Kept on the plan per technique, as
    saved_activations is: the search's cost of one plan asks it twice (its kept saves, then its
    activation terms); the lists are shared, not to be changed by the callers."""
    cache = plan.__dict__.setdefault("_checkpointed_saves", [])
    for done, got in cache:
        if done == technique:
            return got
    got = _checkpointed_saves(plan, technique)
    cache.append((technique, got))
    return got


def block_map(plan, blocks: set) -> dict:
    """Node -> its checkpointed block among ``blocks`` (block_of), for every node of the plan's
    graph that has one: read once per plan and blocks, where each save, each block node and
    each of its inputs asked again (~1,200 module-path walks per plan on a 405B's short graph)."""
    key = (frozenset(blocks), len(plan.graph.nodes))  # a graph grown since: read again
    cache = plan.__dict__.setdefault("_block_maps", {})
    if key not in cache:
        cache[key] = {n: b for n in plan.graph.nodes if (b := block_of(n, blocks)) is not None}
    return cache[key]


def _checkpointed_saves(plan, technique) -> tuple[list[Saved], dict[str, list[Saved]], list[Saved]]:
    blocks = set(plan.built[technique.name])
    where = block_map(plan, blocks)
    nodes = {n.name: n for n in plan.graph.nodes}
    keep = technique.kept_nodes(plan)
    kept, redone, edges = [], {b: [] for b in blocks}, []
    for s in saved_activations(plan):
        block = where.get(nodes[s.consumer])
        if block is None:
            kept.append(s)
            continue
        inside = s.producer is not None and where.get(nodes[s.producer]) == block
        if not inside and s.producer is not None:
            edges.append(s)  # the block's input: the checkpoint holds it
        elif (s.producer or s.consumer) in keep:
            edges.append(s)  # a selective policy keeps this op's outputs
        else:
            redone[block].append(s)
    edges += _block_inputs(plan, where)
    # a selective policy stores every output of the ops it keeps, read by backward or not
    # (consumer "<op>:cache": the policy's cache holds it, no backward op; alive in a recompute
    # only while the recompute reads it, unless a backward op saves it too)
    edges += [Saved(f"{n.name}:cache", n.name, 0) for n in plan.graph.nodes if n.name in keep]
    if technique.mode == "selective":
        edges += _collective_outputs(plan, where)
    if not technique.offload:
        return kept + edges, redone, []
    host = [s for s in edges if _offloaded(s, nodes, blocks, plan.ctx.needs_grad.get)]
    return kept + [s for s in edges if s not in host], redone, host


def _offloaded(s: Saved, nodes: dict, blocks: set, plan_needs_grad) -> bool:
    """Whether an offloading region keeps ``s`` in host memory (recompute.Region): its
    inputs that autograd made (floating point, made outside the block with a gradient) and
    everything its selective policy keeps (the tensors made inside it, collectives' outputs)."""
    if s.producer is None or s.index == -1:
        return True  # a kept op's own tensor (attention's log-sum-exp), a collective's output
    block = block_of(nodes[s.consumer.split(":")[0]], blocks)
    producer = nodes[s.producer]
    if block_of(producer, blocks) == block:
        return True
    val = producer.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    v = vals[s.index] if s.index < len(vals) else None
    return isinstance(v, torch.Tensor) and v.is_floating_point() and bool(plan_needs_grad(producer))


def _collective_outputs(plan, where: dict) -> list[Saved]:
    """The outputs of the collectives on a block's edges (kept by the selective policy): one per
    edge layout that communicates (all-reduce, all-gather, Megatron's f), at the input's size;
    ``where``: node -> its block (block_map)."""
    seen, out = set(), []
    f_edges = plan.flow.f_edges
    for node in plan.graph.nodes:
        if "autopar" not in node.meta or node not in where or not layout_of(node).outputs:
            continue
        lay = layout_of(node)
        for i, (inp, tgt) in enumerate(zip(lay.inputs, lay.input_targets)):
            moved = "autopar" in inp.meta and layout_of(inp).spec != tgt
            if (moved or (node.name, i) in f_edges) and (inp.name, tgt) not in seen:
                seen.add((inp.name, tgt))
                out.append(Saved(f"{node.name}:{i}", inp.name, -1))
    return out


def _block_inputs(plan, where: dict) -> list[Saved]:
    """Tensors made outside a block and read inside it (the checkpoint keeps them, whether they
    need a gradient or not: rotary tables, masks), each as the storage it views; ``where``:
    node -> its block (block_map)."""
    out = []
    for node in plan.graph.nodes:
        block = where.get(node)
        if block is None or node.op != "call_function":
            continue
        for a in node.all_input_nodes:
            if where.get(a) == block or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            base, idx = base_of(a)
            if base.op == "call_function":
                out.append(Saved(node.name, base.name, idx))
    return out


def checkpointed_terms(plan, technique, sy, terms: dict) -> dict:
    """plan.cost()'s ``activations`` under checkpointing and ``recompute``: what the step's peak
    adds to them; with ``offload``, ``offloaded``: the bytes kept in host memory instead (not
    device memory). A block that draws random numbers also keeps a copy of the generator state
    until its backward (the recompute starts from it: recompute.Region), a CPU
    generator's state in bytes."""
    kept, redone, host = checkpointed_saves(plan, technique)
    peak = checkpointed_recompute(plan, technique, sy)
    blocks = set(plan.built[technique.name])
    where = block_map(plan, blocks)
    drawing = {where.get(n) for n in plan.graph.nodes if n.op == "call_function" and draws_random(n)} - {None}
    snapshots = len(drawing) * initial_state(0).numel()
    out = dict(terms, activations=activation_bytes(plan, sy, kept) + snapshots, recompute=peak)
    if technique.offload:
        out["offloaded"] = activation_bytes(plan, sy, host, with_outputs=False)
    return out


def checkpointed_recompute(plan, technique, sy, only: set | None = None):
    """``recompute``: the most one block's recompute adds at a moment (recompute_peak); ``only``:
    of the blocks among those graph nodes (a pipeline stage's, which runs its backward alone: what
    is freed before a block's recompute is its own later blocks' and, on the last stage, the head's)."""
    if technique.offload and technique.mode == "selective":
        # every tensor of the block is on the device again in its recompute (what the policy kept
        # copied back, the rest recomputed): as a full recompute's. Measured (the bench's five
        # policies): selective+offload's peak equals full+offload's on all three models
        full = dataclasses.replace(technique, mode="full", save=None)
        return recompute_peak(plan, full, sy, *checkpointed_saves(plan, full), only=only)
    return recompute_peak(plan, technique, sy, *checkpointed_saves(plan, technique), only=only)


def recompute_peak(plan, technique, sy, kept: list[Saved], redone: dict, host: list[Saved] = (), only=None):
    """The most the recompute adds to the kept bytes at one moment: block b's backward holds what
    its recompute made (and, offloaded, what it kept in host memory, moved back), while what the
    ops after it kept on the device (the head and loss, the later blocks' kept tensors) is
    already freed by their backwards. Backward's own temporaries (activation gradients) are
    left out. 0 when no block's recompute outweighs what is freed before it. ``only``: the
    blocks and the ops after them among these graph node names (a pipeline stage's: measured, a
    405B-width stage 0 of pp 8 held its block's whole recompute and its gradients, 8.0 GiB a
    micro-batch; 7.0 by this with ``only``, 1.7 by the whole model's, less the head's and loss's
    kept tensors freed before its last block)."""
    order = plan.built[technique.name]  # program order: backward runs them last to first
    nodes = {n.name: n for n in plan.graph.nodes}
    index = {n.name: i for i, n in enumerate(plan.graph.nodes)}
    where = block_map(plan, set(order))
    if only is not None:
        mine = {blk for n, blk in where.items() if n.name in only}
        order = [b for b in order if b in mine]
    first = min((index[n.name] for n in plan.graph.nodes if where.get(n) in order), default=0)
    by_block, back = {b: [] for b in order}, {b: [] for b in order}
    tail = []
    for s in kept:
        made = s.consumer.split(":")[0]
        if only is not None and made not in only:
            continue
        block = where.get(nodes[made])
        if block in by_block:
            by_block[block].append(s)
        elif block is None and index.get(made, 0) > first:
            tail.append(s)
    for s in host:  # moved back for the recompute
        block = where.get(nodes[s.consumer.split(":")[0]])
        if block in back:
            back[block].append(s)
    freed = activation_bytes(plan, sy, tail, with_outputs=False)
    best, best_value = 0, 0.0
    for b in reversed(order):
        redo = redone.get(b, [])
        grads = GRADIENTS_ALIVE * _largest(plan, sy, redo) if technique.mode == "full" else 0
        extra = activation_bytes(plan, sy, redo + back[b], with_outputs=False) - freed + grads
        if sy.value(extra) > best_value:
            best, best_value = extra, sy.value(extra)
        freed = freed + activation_bytes(plan, sy, by_block[b], with_outputs=False)
    return best


# While the backward of a recomputed tensor runs, its gradient and its input's gradient are alive
# beside what the recompute made: two tensors of the block's largest recomputed size. Measured
# (bench/bench_activation_checkpoint.py, GPT / LLaMA / MLP stack, 4 gloo ranks): full-recompute
# peaks read 11-28% above the model without them, within 5% with them. Under a selective policy
# the largest tensors (matmul outputs) are kept, not recomputed, and the model without the term
# already reads 7-12% above the measured peaks (14-21% with it): it is left out there.
GRADIENTS_ALIVE = 2


def _largest(plan, sy, saves: list[Saved]):
    sizes = [activation_bytes(plan, sy, [s], with_outputs=False) for s in saves]
    return max(sizes, key=sy.value) if sizes else 0
