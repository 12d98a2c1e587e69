"""Dry runs of pipelined plans: a rank's PipelineRunner driven through its schedule in the fake world
(plan.dry_run asks the technique's runtime hook ``dry_run_rank``: ``PipelineDryRank``).

A pipeline rank's program is its stage modules, run by the runner's schedule actions (forward,
backward, W), with point-to-point messages between neighbouring stages, the gradient sync after
the last micro-batch and the step's loss in one all-reduce. In a fake world of one rank nobody
else runs: ``FakeChannel`` (the channel the fake world's backend gives the runner, p2p.channel)
records each message as the rank sends it (kind ``send``, the pipeline axis, its bytes as it
travels) and keeps the tensor until the schedule lets go of it, as DistChannel does; a receive
is a fake tensor of the shape the producing stage sends: the value's traced shape, its symbolic
sizes evaluated at the micro-batch's inputs, cut as the plan lays the value out on this rank
(``BoundaryShapes``; a rank's sizes are the plan's: ``dry_run(rank=None)`` runs every pipeline
position, and each one's receives equal what its neighbours' runs sent, which the tests check).
An integer crossing a boundary (a ``sym_size``) is a real one-element tensor: the receiving
stage reads its value.

``predicted`` gives the plan's figures for the rank: its stages' collectives (each micro-batch
runs them: ``plan.collectives()`` lists the whole model's once), the other techniques' collectives
the rank runs (their cost hook ``rank_collectives``: zero=3's buckets of the rank's stages), its
point-to-point messages from the schedule at the memory model's sizes (stage_memory: the value's
formula at the micro-batch), and plan.cost(rank)'s FLOPs (its stages' nodes).

Example:
    >>> run = plan.dry_run(rank=0).runs[0]       # a pipelined plan: stage 0's rank
    >>> [c for c in run.collectives if c[0] == "send"][:1]    # [("send", "pp", 268435456.0)]
"""

from __future__ import annotations

import sympy
import torch
import torch.utils._pytree as pytree

from autopar.cost.collectives import _sync_comms, collectives
from autopar.cost.formulas import PlanSymbols
from autopar.parallel.pipeline import messages, schedules
from autopar.parallel.pipeline.p2p import HeldSends, SelfMessages
from autopar.parallel.param_names import held_params, stored_pieces
from autopar.parallel.pipeline.api import tied_rank_groups
from autopar.parallel.pipeline.runner import PipelineRunner, loss_group
from autopar.parallel.pipeline.stage_memory import _micro_batch, _value_bytes
from autopar.parallel.protocols.runtime import DryRank
from autopar.placement import Shard, local_shape
from autopar.runtime.backend import current_backend
from autopar.runtime.comm_stats import group_label
from autopar.runtime.ring import ring_bytes
from autopar.sharding.propagate import layout_of
from autopar.trace.in_dtype import materialized

INT_BYTES = 8  # an integer crosses a boundary as one int64 (runner._wire)


class P2PRecord:
    """One point-to-point message in a CommStats list (its kind, axis and bytes, like a Record's)."""

    def __init__(self, kind: str, axis: str, nbytes: int, peer: int):
        self.kind, self.axis, self.bytes, self.peer = kind, axis, float(nbytes), peer
        self.group = (peer,)


class BoundaryShapes:
    """The local shape (or the integer) of a boundary value for one micro-batch on ``rank``."""

    def __init__(self, plan, rank: int):
        self.plan, self.rank, self.coords = plan, rank, plan.mesh.coords(rank)
        self.nodes = {n.name: n for n in plan.graph.nodes}
        self.cache: dict = {}

    def _subs(self, inputs: dict) -> dict:
        """Each symbolic input size -> its value at this micro-batch, in the graph's global sizes
        (the rank's piece times the pieces its input spec cuts it into)."""
        plan, subs = self.plan, {}
        for name, spec in zip(plan.traced.user_inputs, plan.input_specs):
            val, t = self.nodes[name].meta.get("val"), inputs.get(name)
            if not isinstance(val, torch.Tensor) or not isinstance(t, torch.Tensor):
                continue
            sizes = list(t.shape)
            for axis, p in enumerate(spec or ()):
                if isinstance(p, Shard) and p.dim < len(sizes):
                    sizes[p.dim] *= p.pieces(plan.mesh.shape[axis])
            for d, s in zip(val.shape, sizes):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    subs[d.node.expr] = sympy.Integer(s)
        return subs

    def _size(self, d, subs) -> int:
        if not isinstance(d, torch.SymInt):
            return int(d)
        expr = sympy.sympify(d.node.expr).xreplace(subs)
        return int(expr) if expr.is_number else int(d.node.hint)

    def value(self, name: str, inputs: dict):
        """(shape, None) of a tensor value, or (None, the integer) of an int one."""
        key = (name, tuple((k, tuple(v.shape)) for k, v in inputs.items() if isinstance(v, torch.Tensor)))
        if key not in self.cache:
            val, subs = self.nodes[name].meta.get("val"), self._subs(inputs)
            if isinstance(val, torch.Tensor):
                full = [self._size(d, subs) for d in val.shape]
                shape = local_shape(full, layout_of(self.nodes[name]).spec, self.plan.mesh, self.coords)
                self.cache[key] = (tuple(shape), None)
            else:
                self.cache[key] = (None, self._size(val, subs))
        return self.cache[key]


class FakeChannel(HeldSends):
    """The runner's p2p channel in a fake world (the module docstring): sends recorded and kept
    until released, receives made at their shapes, buffers posted ahead once a stream is known."""

    def __init__(self, plan, rank: int, device, stats, runner):
        self.plan, self.rank, self.device, self.stats = plan, rank, device, stats
        self.axis = plan.mesh.axis_names[plan.stage_layout.axis]
        self.shapes = BoundaryShapes(plan, rank)
        self.runner = runner  # its micro-batch inputs size the receives
        self.pending: dict = {}  # (dst, tag) -> the sent tensor, until released
        self.posted: dict = {}  # (src, tag) -> a buffer posted ahead
        self.local = SelfMessages(rank)
        self.known: set = set()  # (src, stream) whose first message came (its shape known)

    def _record(self, kind: str, nbytes: int, peer: int) -> None:
        with self.stats._lock:
            self.stats.records.append(P2PRecord(kind, self.axis, nbytes, peer))

    def send(self, x: torch.Tensor, dst: int, tag: int, stream=None) -> None:
        if dst == self.rank:
            return self.local.put(x, tag)
        x = x.detach()
        self.pending[(dst, tag)] = x
        self._record("send", x.numel() * x.element_size(), dst)

    def _make(self, tag: int, dtype, stream):
        lay = self.plan.stage_layout
        mb = tag // (2 * lay.n_stages * len(lay.value_ids))  # runner._tag's micro-batch
        shape, number = self.shapes.value(stream[0], self.runner._inputs[mb])
        if shape is None:
            return torch.tensor([number], dtype=torch.int64)  # a constant: the stage reads its value
        return torch.empty(shape, dtype=dtype, device=self.device)

    def prefetch(self, src: int, tag: int, dtype, stream) -> bool:
        if src == self.rank or (src, stream) not in self.known:
            return False
        if (src, tag) not in self.posted:
            self.posted[(src, tag)] = self._make(tag, dtype, stream)
        return True

    def recv(self, src: int, tag: int, dtype=torch.float32, stream=None) -> torch.Tensor:
        if src == self.rank:
            return self.local.take(tag)
        out = self.posted.pop((src, tag), None)
        if out is None:
            out = self._make(tag, dtype, stream)
        self.known.add((src, stream))
        self._record("recv", out.numel() * out.element_size(), src)
        return out


class PipelineDryRank(DryRank):
    """``rank``'s step in the fake world (Pipeline.dry_run_rank): its runner with its stages'
    pieces cut from full-size fake tensors, its messages through a ``FakeChannel`` recorded in
    ``stats``, the example batch as the runner's ``step`` takes it."""

    def __init__(self, plan, rank: int, dev, stats):
        self.plan, self.rank = plan, rank
        self.module = build_runner(plan, rank, dev)
        self.stages = list(self.module.stage_modules)
        channel = FakeChannel(plan, rank, dev, stats, self.module)
        current_backend().p2p_channel = lambda r: channel
        self.inputs = batch(plan, materialized(plan.traced.example, dev))

    def step(self) -> None:
        """The schedule's forwards and backwards, the gradient sync, the loss's all-reduce."""
        self.module.step(self.inputs)

    def predicted(self, state_slots: int) -> tuple[list, float]:
        return predicted(self.plan, self.rank, state_slots)


def build_runner(plan, rank: int, dev) -> PipelineRunner:
    """``rank``'s runner with its stages' pieces cut from full-size fake tensors on ``dev``."""
    lay = plan.stage_layout
    pos = plan.mesh.coords(rank)[lay.axis]
    names = {plan.attr_name(ph) for st in lay.stages if lay.rank_of_stage(st.index) == pos for ph in st.attrs}
    params = plan.model_tensors["params"]
    state = {n: torch.empty(params[n].shape, dtype=params[n].dtype, device=dev) for n in names if n in params}
    return PipelineRunner(plan, rank, measure=False, state=state)


def batch(plan, inputs) -> tuple:
    """The example batch as the runner's ``step`` takes it: every input, positionally, in the
    order the plan was traced with (a model traced with keyword inputs included)."""
    args, kwargs = inputs
    return tuple(pytree.tree_leaves((args, kwargs)))


def predicted(plan, rank: int, optimizer_states: int) -> tuple[list, float]:
    """(the collectives and messages, the FLOPs) the plan says ``rank``'s runner runs in a step."""

    lay, o = plan.stage_layout, plan.stage_layout.options
    pos = plan.mesh.coords(rank)[lay.axis]
    mine = [st for st in lay.stages if lay.rank_of_stage(st.index) == pos]
    nodes = {n for st in mine for n in st.nodes}
    out_node = next(n.name for n in plan.graph.nodes if n.op == "output")
    if any(st.has_output for st in mine):  # the model's outputs leave the last stage as the plan's do
        nodes.add(out_node)
    sy = PlanSymbols.of(plan)
    micro = _micro_batch(plan, sy, o.microbatches)
    comms = collectives(plan, sy, grad_sync=False)
    out = []
    for c in comms:
        if c.node in nodes:  # every micro-batch runs its stage's collectives (and their recompute)
            b = sy.value(sympy.sympify(c.formula).xreplace(micro))
            out += [(c.kind, c.axis, b)] * o.microbatches
    for technique in plan.options.techniques:  # the others' own (zero=3: the buckets of its stages)
        out += [(c.kind, c.axis, c.bytes) for c in technique.rank_collectives(plan, rank, comms, o.microbatches)]
    out += rank_sync(plan, rank, sy)
    out += messages_of(plan, rank, sy, micro)
    flops = float(plan.cost(optimizer_states=optimizer_states, rank=rank).at()["flops"])
    return out, flops


def rank_sync(plan, rank: int, sy) -> list:
    """The gradient sync of the rank's own parameters (its buckets), the tied weights' sums over
    the pipeline ranks that hold them, and the step's loss in one all-reduce (runner.py)."""

    out = [(c.kind, c.axis, c.bytes) for c in _sync_comms(plan, sy, rank, stored_pieces(plan, rank))]
    held = held_params(plan, rank)
    for group in tied_rank_groups(plan):
        if rank in group:
            names = next(ns for ns in plan.traced.tied.values() if any(n in held for n in ns))
            p = held[next(n for n in names if n in held)]
            nbytes = ring_bytes("all_reduce", p.numel() * p.element_size(), len(group))
            out.append(("all_reduce", group_label(group, plan.mesh), float(nbytes)))
    results = 1 if plan.stage_layout.options.metric is None else 2
    group = loss_group(plan, rank)
    out.append(("all_reduce", group_label(group, plan.mesh), float(ring_bytes("all_reduce", 4 * results, len(group)))))
    return out


def messages_of(plan, rank: int, sy, micro) -> list:
    """The point-to-point messages of ``rank``'s schedule in a step: (send / recv, axis, bytes)."""
    lay, o = plan.stage_layout, plan.stage_layout.options
    pos = plan.mesh.coords(rank)[lay.axis]
    axis = plan.mesh.axis_names[lay.axis]
    acts = schedules.build(o.kind, lay.pp, o.microbatches, o.chunks)[pos]
    sizes: dict = {}

    def nbytes(name):
        if name not in sizes:
            if lay.kinds[name] == "int":
                sizes[name] = INT_BYTES
            else:
                sizes[name] = sy.value(sympy.sympify(_value_bytes(plan, sy, name)).xreplace(micro))
        return sizes[name]

    out = []
    for a in acts:
        for m in messages.received(lay, a):
            if lay.rank_of_stage(m.src) != pos:
                out.append(("recv", axis, nbytes(m.value)))
        for m in messages.sent(lay, a):
            if lay.rank_of_stage(m.dst) != pos:
                out.append(("send", axis, nbytes(m.value)))
    return out
