"""The activations one pipeline rank holds: what its runner keeps alive between actions, walked
along its schedule (the cost model's ``activations`` for a pipelined plan,
cost/activation_memory.py being the whole model's at the whole batch).

The runner (parallel/pipeline/runner.py) keeps, per micro-batch of each of its stages, from the
forward to its backward: the stage's inputs (received values: buffers of their own; user inputs
are the caller's) and what it sent (its outputs, kept to run backward from); without
``Pipeline(checkpoint=True)`` also the tensors autograd saves in the stage's ops (as the other
techniques keep them: checkpointed blocks their inputs) and, on the last stage, the model's
outputs the loss reads; with it nothing else (the stage is recomputed just before its backward:
``recompute``, one micro-batch of the stage, whole). Beside those, the messages (measured on 4
gloo ranks: 34-74% of what a checkpointed stage holds when they were left out):

- a sent tensor stays alive until the schedule proves it arrived (messages.releases: the first
  of the rank's actions receiving a message its receiver sent after consuming ours), a forward's
  output until its backward too; a backward's gradients from that backward to their release;
- a prefetched receive's buffer from the action before the one that reads it (the runner posts
  the receives of the next action, once its stream's shape is known: from its second message);
- a message to the rank itself (two chunks of one rank) is a copy, alive from the send to the
  backward of the micro-batch that reads it.

Under a zero-bubble schedule ("zb-h1") a micro-batch's stage is held until its W, not its B; from
its B to its W also the gradients B computed at the ops that read a parameter (what W starts
from: one output gradient of each such op, split_backward.py), and under checkpoint=True the
recomputed stage whole (recomputed before B, freed by W).

Sizes are the plan's formulas with every user input's batch dim divided by the micro-batch count
(the runner splits dim 0). ``activations`` is the most held after any of the rank's actions.

Example:
    >>> plan.memory_per_rank(0)["activations"]     # stage 0's, along its 1F1B actions
    >>> plan.cost().at()["memory"]["activations"]  # the rank that holds the most
"""

from __future__ import annotations

import sympy
import torch

from autopar.cost.activation_memory import activation_bytes, draws_random, saved_activations, tensor_bytes
from autopar.cost.formulas import Numbers, PlanSymbols
from autopar.cost.plan_cost import activation_terms
from autopar.parallel.pipeline import messages, schedules
from autopar.runtime.rng import initial_state
from autopar.parallel.pipeline.schedules import Action


def rank_terms(plan, pipeline, sy, terms: dict, rank: int | None) -> dict:
    """``terms`` (activations, and the other techniques' recompute / offloaded) for pipeline rank
    ``rank``'s stages (None: the rank whose activations are largest at the example)."""
    numbers = isinstance(sy, Numbers)
    formulas = PlanSymbols.of(plan) if numbers else sy
    if numbers:  # the micro-batch is the batch symbols divided: the whole-model terms as formulas
        terms = activation_terms(plan, formulas, whole_model=True)
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
    built = schedules.build(pipeline.kind, lay.pp, m, pipeline.chunks)
    actions = built[pos]
    at_micro: dict = {}  # bytes at the plan's batch -> (at the micro-batch's, its value at the example)
    spans = []
    for start, end, nbytes in held_intervals(plan, pipeline, sy, built, pos):
        if nbytes not in at_micro:
            b = sympy.sympify(nbytes).xreplace(micro)
            at_micro[nbytes] = b, sy.value(b)
        spans.append((start, end, *at_micro[nbytes]))
    held = [0.0] * len(actions)  # numbers first (a formula only for the fullest point)
    for start, end, _, v in spans:
        for k in range(start, end):
            held[k] += v
    top = max(range(len(held)), key=held.__getitem__, default=None)
    peak = sum((b for start, end, b, _ in spans if start <= top < end), sympy.Integer(0)) if held else sympy.Integer(0)
    out = dict(terms, activations=peak)
    mine = [st for st in lay.stages if lay.rank_of_stage(st.index) == pos]
    if pipeline.checkpoint:  # one micro-batch of a stage recomputed whole, just before its backward
        whole = [sympy.sympify(_kept_bytes(plan, sy, st, own=True)).xreplace(micro) for st in mine]
        out["recompute"] = max(whole, key=sy.value)
    elif "recompute" in terms:  # checkpointed blocks inside the stage: one of its blocks, one micro-batch
        got = [t.nodes_recompute(plan, sy, set(st.nodes)) for st in mine for t in plan.options.techniques]
        got = [sympy.sympify(g).xreplace(micro) for g in got if g is not None]
        out["recompute"] = max(got, key=sy.value) if got else sympy.sympify(terms["recompute"]).xreplace(micro)
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


def held_intervals(plan, pipeline, sy, built, pos: int) -> list[tuple[int, int, object]]:
    """(first, end, bytes) for each tensor pipeline position ``pos``'s runner holds: alive after
    its actions first .. end - 1 (indices into ``built[pos]``), at the plan's batch (the caller
    divides the batch dims by the micro-batch count)."""
    lay = plan.stage_layout
    acts = built[pos]
    n, where = len(acts), {a: i for i, a in enumerate(acts)}
    release = {msg: j for j, found in messages.releases(lay, built, pos).items() for msg in found}
    values: dict = {}

    def size(name):
        if name not in values:
            values[name] = _value_bytes(plan, sy, name)
        return values[name]

    def local(msg):  # between two chunks of this rank: a copy handed over, no pending send
        return lay.rank_of_stage(msg.src) == lay.rank_of_stage(msg.dst)

    own = {}  # stage -> what its ops keep beyond its received and sent values
    out = []
    split = any(a.kind == "W" for a in acts)
    freed_by = "W" if split else "B"  # zero-bubble: W needs the activations
    kept_for_w = {}  # stage -> what it holds from its B to its W beyond its forward's
    for i, a in enumerate(acts):
        st = lay.stages[a.stage]
        if a.kind == "F":
            done = where.get(Action(freed_by, a.microbatch, a.stage), n)  # forward-only: to the step's end
            if a.stage not in own:
                own[a.stage] = (
                    _replay_bytes(plan, st)
                    if pipeline.checkpoint
                    else _kept_bytes(plan, sy, st, own=False, boundary=False)
                )
            out.append((i, done, own[a.stage]))
            for msg in messages.received(lay, a):  # the stage's inputs, until its backward
                first = where.get(messages.sender_action(msg), i) if local(msg) else i
                out.append((first, done, size(msg.value)))
            for name, dsts in st.send:  # one tensor, sent to each reader, kept for the backward
                ends = [release.get(messages.Message(name, a.microbatch, a.stage, d, 0), n) for d in dsts
                        if lay.rank_of_stage(d) != pos]  # fmt: skip
                out.append((i, max([done, *ends]), size(name)))
        elif a.kind == "B":
            if split:
                if a.stage not in kept_for_w:
                    kept_for_w[a.stage] = _weight_grad_starts(plan, sy, st) + (
                        _kept_bytes(plan, sy, st, own=False, boundary=False) if pipeline.checkpoint else 0
                    )
                out.append((i, where.get(Action("W", a.microbatch, a.stage), n), kept_for_w[a.stage]))
            for msg in messages.sent(lay, a):  # gradients: pending sends, or copies to a chunk of ours
                end = where.get(messages.consumer_action(msg), n) if local(msg) else release.get(msg, n)
                out.append((i, end, size(msg.value)))
    for post, taken, msg in messages.posted_at(lay, acts, pos):  # receive buffers posted ahead
        if post < taken:
            out.append((post, taken, size(msg.value)))
    return out


def _weight_grad_starts(plan, sy, st):
    """The output gradients a zero-bubble B keeps for its W: one per op of the stage that reads a
    parameter (or a value made from parameters alone, a transpose) and a value on the way to the
    stage's received inputs. A first stage (nothing received) keeps none: its B does nothing."""
    if not any(True for name, _ in st.recv):
        return 0
    params = {n for n, _ in plan.model.named_parameters(remove_duplicate=False)}
    from_params = {ph for ph in st.attrs if plan.attr_name(ph) in params}
    nodes = {n.name: n for n in plan.graph.nodes}
    starts = []
    for name in st.nodes:
        node = nodes[name]
        ins = [a.name for a in node.all_input_nodes]
        if ins and all(i in from_params for i in ins):
            from_params.add(name)
        elif any(i in from_params for i in ins) and any(_floating(nodes[i]) for i in ins if i not in from_params):
            starts.append(node)
    names = {n.name for n in starts}
    total = sympy.Integer(0)
    for node in starts:  # an add passes its output's gradient on as it is: a linear then its bias, one tensor
        users = list(node.users)
        if len(users) == 1 and users[0].target is torch.ops.aten.add.Tensor and users[0].name in names:
            continue
        total = total + tensor_bytes(plan, sy, node.name)
    return total


def _floating(node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _replay_bytes(plan, st) -> int:
    """What a checkpointed stage keeps per micro-batch beside its inputs: a copy of the stage's
    dropout generator state when it draws (the recompute replays the forward's masks), a CPU
    generator's state in bytes. (The runner also keeps ``torch.get_rng_state()``, as many bytes
    again, made outside any op: LiveBytes does not see it, and the model leaves it out.)"""
    names = set(st.nodes)
    drawing = any(draws_random(n) for n in plan.graph.nodes if n.name in names and n.op == "call_function")
    return initial_state(0).numel() if drawing else 0


def _kept_bytes(plan, sy, st, own: bool, boundary: bool = True):
    """What autograd keeps in the stage's ops (``own``: as autograd alone would; else as the
    plan's techniques keep it) and on the last stage the model's outputs; ``boundary``: and its
    sent values (else the values it receives and sends are left out: counted as messages)."""
    nodes = set(st.nodes)
    saves = saved_activations(plan)
    if not own:
        for technique in plan.options.techniques:  # checkpointed blocks keep their inputs instead
            saves = technique.kept_saves(plan, saves)
    mine = [s for s in saves if s.consumer.split(":")[0] in nodes]
    if not boundary:
        crossing = {name for name, _ in st.recv} | {name for name, _ in st.send}
        mine = [s for s in mine if s.producer not in crossing or s.index == -1 or s.edge]
    total = activation_bytes(plan, sy, mine, with_outputs=st.has_output)
    if not boundary:
        return total
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
