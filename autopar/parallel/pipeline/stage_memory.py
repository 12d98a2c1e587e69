"""The activations one pipeline rank holds: its own stages' saved tensors, one micro-batch at a
time, times the micro-batches its schedule keeps in flight (the cost model's ``activations``
for a pipelined plan, cost/activation_memory.py being the whole model's at the whole batch).

Per stage and micro-batch (the runner, parallel/pipeline/runner.py, keeps each until its
backward): the tensors autograd saves in the stage's ops (as the other techniques keep them:
checkpointed blocks their inputs), the values it sends (its outputs, kept to run backward
from), and on the last stage the model's outputs; with ``Pipeline(checkpoint=True)`` only the
stage's inputs (received values and user inputs) and what it sent, the rest recomputed just before its
backward (``recompute``: one micro-batch of the stage, whole). Sizes are the plan's formulas
with every user input's batch dim divided by the micro-batch count (the runner splits dim 0).
The schedule's actions for the rank are then walked: a forward adds its stage's bytes, a
backward frees them; ``activations`` is the most held at once (1F1B: pp - r micro-batches on
rank r; GPipe: all m; interleaved: as its order says).

Example:
    >>> plan.memory_per_rank(0)["activations"]     # stage 0's, its 1F1B in-flight micro-batches
    >>> plan.cost().at()["memory"]["activations"]  # the rank that holds the most
"""

from __future__ import annotations

import sympy
import torch

from autopar.cost.activation_memory import activation_bytes, saved_activations, tensor_bytes
from autopar.cost.formulas import Numbers, PlanSymbols
from autopar.parallel.pipeline import schedules


def rank_terms(plan, pipeline, sy, terms: dict, rank: int | None) -> dict:
    """``terms`` (activations, and the other techniques' recompute / offloaded) for pipeline rank
    ``rank``'s stages (None: the rank whose activations are largest at the example)."""
    numbers = isinstance(sy, Numbers)
    formulas = PlanSymbols.of(plan) if numbers else sy
    lay = plan.stage_layout
    positions = range(lay.pp) if rank is None else [plan.mesh.coords(rank)[lay.axis]]
    best, best_value = None, -1.0
    for pos in positions:
        got = _position_terms(plan, pipeline, formulas, terms, pos)
        value = formulas.value(got["activations"])
        if value > best_value:
            best, best_value = got, value
    if numbers:
        return {k: formulas.value(v) for k, v in best.items()}
    return best


def _position_terms(plan, pipeline, sy, terms: dict, pos: int) -> dict:
    lay, m = plan.stage_layout, pipeline.microbatches
    micro = _micro_batch(plan, sy, m)
    held = {st.index: sympy.sympify(stage_bytes(plan, pipeline, sy, st)).xreplace(micro) for st in lay.stages}
    actions = schedules.build(pipeline.kind, lay.pp, m, pipeline.chunks)[pos]
    now, peak, peak_value, in_flight = sympy.Integer(0), sympy.Integer(0), 0.0, 0
    for a in actions:
        now = now + held[a.stage] if a.kind == "F" else now - held[a.stage]
        in_flight += 1 if a.kind == "F" else -1
        if sy.value(now) > peak_value:
            peak, peak_value = now, sy.value(now)
    out = dict(terms, activations=peak)
    mine = [st for st in lay.stages if lay.rank_of_stage(st.index) == pos]
    if pipeline.checkpoint:  # one micro-batch of a stage recomputed whole, just before its backward
        whole = [sympy.sympify(_kept_bytes(plan, sy, st, own=True)).xreplace(micro) for st in mine]
        out["recompute"] = max(whole, key=sy.value)
    elif "recompute" in terms:  # checkpointed blocks inside the stage: one block, one micro-batch
        out["recompute"] = sympy.sympify(terms["recompute"]).xreplace(micro)
    if "workspace" in terms:  # one lowered op's buffers while it runs (cp attention): one micro-batch
        out["workspace"] = sympy.sympify(terms["workspace"]).xreplace(micro)
    if "backward" in terms:  # the loss's backward: the last stage's, one micro-batch
        last = any(st.has_output for st in mine)
        out["backward"] = sympy.sympify(terms["backward"]).xreplace(micro) if last else sympy.Integer(0)
    if "offloaded" in terms:  # host copies, for each micro-batch in flight (the stages' share)
        share = sum(len(st.nodes) for st in mine) / max(1, sum(len(st.nodes) for st in lay.stages))
        most = schedules.max_in_flight(actions)
        out["offloaded"] = sympy.sympify(terms["offloaded"]).xreplace(micro) * share * most
    return out


def stage_bytes(plan, pipeline, sy, st):
    """Bytes one micro-batch of stage ``st`` holds from its forward to its backward (at the
    plan's batch: the caller divides the batch dims by the micro-batch count)."""
    if pipeline.checkpoint:  # the runner keeps the stage's inputs and what it sent only
        names = [name for name, _ in st.recv] + list(st.inputs) + [name for name, _ in st.send]
        return sum((_value_bytes(plan, sy, n) for n in names), sympy.Integer(0))
    return _kept_bytes(plan, sy, st, own=False)


def _kept_bytes(plan, sy, st, own: bool):
    """What autograd keeps in the stage's ops (``own``: as autograd alone would; else as the
    plan's techniques keep it), its sent values, and on the last stage the model's outputs."""
    nodes = set(st.nodes)
    saves = saved_activations(plan)
    if not own:
        for technique in plan.options.techniques:  # checkpointed blocks keep their inputs instead
            saves = technique.kept_saves(plan, saves)
    mine = [s for s in saves if s.consumer.split(":")[0] in nodes]
    total = activation_bytes(plan, sy, mine, with_outputs=st.has_output)
    counted = {s.producer for s in mine}
    for name, _ in st.send:  # the runner keeps what it sent, to run backward from
        if name not in counted:
            total = total + _value_bytes(plan, sy, name)
    return total


def _value_bytes(plan, sy, name: str):
    node = next((n for n in plan.graph.nodes if n.name == name), None)
    if node is None or not isinstance(node.meta.get("val"), torch.Tensor):
        return sympy.Integer(0)
    return tensor_bytes(plan, sy, name)


def _micro_batch(plan, sy, m: int) -> dict:
    """Each user input's batch symbol -> ceiling(itself / m): the runner cuts dim 0 into m pieces as
    torch.tensor_split does, so the largest micro-batch has that many rows."""
    out = {}
    for node in plan.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and node.name in plan.traced.user_inputs and isinstance(val, torch.Tensor):
            if val.dim() and isinstance(val.shape[0], torch.SymInt):
                b = sy.dim(val.shape[0])
                for s in b.free_symbols:
                    out[s] = sympy.ceiling(s / m)
    return out
