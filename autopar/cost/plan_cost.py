"""plan.cost(): communication, memory and time per rank as sympy formulas.

Communication comes from plan.collectives() (the one list of what runs), memory from the
parameter specs and the layouts of the activations, compute from a FLOP count per op.
Every formula is in the plan's named dims (B, S, ...), mesh axis sizes (dp, tp) and any
static sizes you name; ``at()`` evaluates them (at the example unless told otherwise).

Memory per rank: ``params`` and ``grads`` (trainable parameters' local pieces),
``optimizer`` (``optimizer_states`` copies of the trainable pieces in their dtype, 2 for Adam),
``activations`` (the tensors autograd saves for backward and the model's outputs, each storage
once, at its local size: cost/activation_memory.py; activation checkpointing keeps fewer and
adds ``recompute``, one block's recompute at its peak; ``workspace``: what the largest lowered op
holds beyond its kept tensors while it runs, context-parallel attention's fp32 accumulators and
key blocks, Lowering.workspace; ``backward``: what the loss's backward holds beyond those, two
gradients of the loss's largest kept tensor, where they outweigh recompute + workspace;
``outputs``: where a model returning its loss gives other outputs gathered (cp's logits), what
their gathering holds at the forward's end beyond all of those: activations + recompute +
workspace + backward + outputs is the step's peak less the parameters' state).
Time: per collective ``alpha * rounds + bytes / beta`` (ring: 2(n-1) rounds for all-reduce, n-1
otherwise), compute ``flops / flops_per_s`` with backward counted as twice the forward (with a
memory ``bandwidth``, each op's roofline: cost/op_time.py); the total adds them (no overlap assumed).

Example:
    >>> c = plan.cost(sizes={"H": 32})
    >>> c.comm["tp"]                 # 32*B*S*H*(tp - 1)/(dp*tp)  (bytes per step and rank)
    >>> c.at(B=64)["comm"]["tp"]     # a number
    >>> c.time(alpha=5e-6, beta=25e9, flops_per_s=1e12)["total"]
    >>> c.steps()                    # ring attention: {node: {steps, compute, shift}} per step
"""

from __future__ import annotations

from collections import defaultdict

import sympy
import torch

from autopar.cost.activation_memory import (
    activation_bytes,
    dropped_outputs_bytes,
    loss_backward_bytes,
    workspace_bytes,
)
from autopar.cost.collectives import collectives
from autopar.cost.formulas import Numbers, PlanSymbols, simplify
from autopar.cost.op_time import (
    ATTENTION_BACKWARD,
    node_flops,
    node_seconds,
    op_work,
    optimizer_step_bytes,
    split_factor,
)
from autopar.placement import Shard, is_uneven
from autopar.sharding.lowerings.base import lowering_for
from autopar.runtime.ring import ring_steps
from autopar.sharding.propagate import layout_of, tensor_outputs
from autopar.trace.model_members import named_parameters


def layer_of(path: str) -> str:
    """'blocks.3.mlp.fc' -> 'blocks.3' (up to the first index); a path without an index stays
    whole ('lm_head', 'model.embed_tokens'); '' -> '(top)'."""
    if not path:
        return "(top)"
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return path


# One optimizer state (Adam's moments) per element is in the dtype of the parameter it steps:
# torch's optimizers make it with zeros_like(param). A precision policy keeps fp32 masters
# (parallel/data_parallel/precision.py), so its state is fp32; a bf16 model stepped by plain AdamW keeps bf16
# moments (measured: a dry run of LLaMA-8B in bf16 holds 3.74 GiB of state on 8 ranks, not 7.48).
# So the state's bytes are ``slots x`` the stepped parameters' own bytes, nowhere a constant.


def copy_dtype(plan, dp="plan") -> torch.dtype | None:
    """The dtype of the copies a precision policy's program makes of the parameters it reads: its
    ``param_dtype``, the dtype the plan was traced in (``plan.traced.dtype``, parallel/data_parallel/precision.py).
    None where it makes none of its own: without a policy, or where ``dp``'s storage gathers the
    parameters (zero=3: the gathers cast, their blocks are the storage's ``gathered``). ``dp``:
    the plan's DataParallel unless another is given (the search weighs others on one plan).

    Example:
        >>> copy_dtype(plan)      # torch.bfloat16 under DataParallel("dp", zero=1, param_dtype=bf16)
    """
    dtype, dp = plan.traced.dtype, plan.state_storage if dp == "plan" else dp
    if dtype is None or (dp is not None and dp.storage.gathers_params):
        return None
    return dtype


def copy_bytes(p: torch.Tensor, numel, dtype: torch.dtype | None):
    """Bytes of ``dtype``'s copy of ``numel`` elements of parameter ``p`` (a number or a formula):
    0 where no copy is made (no dtype, an integer parameter, one already in ``dtype``, whose cast
    returns it; callers pass None for a parameter kept in fp32, ``plan.traced.kept_fp32``). Under the policy each copy lives from its read in forward to its last use in
    backward (autograd keeps it for the matmul's gradient), as FSDP2's unsharded copies do, so a
    rank holds all of them at its peak."""
    if dtype is None or not p.is_floating_point() or p.dtype == dtype:
        return 0
    return numel * dtype.itemsize


class Cost:
    """Formulas for one plan (see the module docstring); ``at(**dims)`` gives numbers."""

    def __init__(
        self, plan, sizes: dict | None = None, names: dict | None = None, optimizer_states: int = 2, rank=None
    ):
        self.plan = plan
        # one rank's memory (None: the rank that holds the most, plan.peak_memory_rank)
        self.rank = plan.peak_memory_rank(optimizer_states) if rank is None else plan.mesh.check_rank(rank)
        self.sy = PlanSymbols.of(plan, sizes, names)
        self.comms = collectives(plan, self.sy)
        self.comm = _sum_by(self.comms, lambda c: c.axis)
        self.comm_by_phase = _sum_by(self.comms, lambda c: (c.axis, c.phase))
        self.comm_by_layer = _sum_by(
            self.comms, lambda c: (layer_of(c.module) if c.phase != "grad sync" else "(grad sync)", c.axis)
        )
        self.states = optimizer_states
        memory = memory_formulas(plan, self.sy, optimizer_states, self.rank)
        self.host_memory = {k: memory.pop(k) for k in HOST_PARTS if k in memory}  # not the device's
        self.memory = memory
        # the step's peak: the largest phase (memory_phases), the figure ap.predict and
        # memory_per_rank(rank).peak give
        self.memory_phases = memory_phases(memory, **phase_flags(plan))  # phase -> formula
        self.peak_memory = sympy.Max(*[sympy.sympify(v) for v in self.memory_phases.values()])
        self.flops = flops_formula(plan, self.sy, self.rank)

    @property
    def symbols(self) -> dict[str, sympy.Symbol]:
        return {s.name: s for s in self.sy.example}

    @property
    def example(self) -> dict[str, int]:
        return {s.name: v for s, v in self.sy.example.items()}

    def at(self, **values) -> dict:
        """Every formula as a number at the example, with ``values`` (by name) replacing some."""
        ev = lambda e: self.sy.value(e, **values)  # noqa: E731
        return {
            "comm": {k: ev(v) for k, v in self.comm.items()},
            "memory": {k: ev(v) for k, v in self.memory.items()},
            "peak_memory": ev(self.peak_memory),
            "flops": ev(self.flops),
        }

    def time(self, alpha=5e-6, beta=25e9, flops_per_s=1e12, bandwidth=None, attention_flops_per_s=None) -> dict:
        """Seconds per step as formulas: alpha-beta per collective; compute per op, its FLOPs at
        ``flops_per_s`` or, with a memory ``bandwidth`` (B/s), the longer of that and its bytes
        at the bandwidth (cost/op_time.py: the roofline ap.predict and the search use),
        checkpointed regions' forward counted again; with a bandwidth also ``optimizer``, the
        optimizer step's bytes (op_time.optimizer_step_bytes) at it.

        Pass a string (e.g. ``alpha="alpha"``) to keep that parameter a symbol."""
        alpha, beta, fps, bw, attn = (
            sympy.Symbol(v, positive=True) if isinstance(v, str) else v
            for v in (alpha, beta, flops_per_s, bandwidth, attention_flops_per_s)
        )
        comm = defaultdict(lambda: sympy.Integer(0))
        for c in self.comms:
            n = self.sy.axis(c.axis)
            comm[c.axis] += alpha * ring_steps(c.kind, n) + formula_of(c) / beta
        compute = compute_seconds(self.plan, self.sy, fps, bw, attn)
        out = {"compute": compute, "comm": dict(comm), "total": compute + sum(comm.values())}
        if bw is not None:
            out["optimizer"] = self.step_bytes / bw
            out["total"] += out["optimizer"]
        return out

    @property
    def step_bytes(self) -> sympy.Expr:
        """Bytes the optimizer step moves on a rank: its state (``memory["optimizer"]``, as ZeRO
        shards it) and the parameters it steps with their gradients (as many bytes per state
        byte as the model's trainable parameters have)."""
        trained = [p for _, p in named_parameters(self.plan.model) if p.requires_grad]
        grads = sum(p.numel() * p.element_size() for p in trained)
        states = grads * self.states  # each state in its parameter's dtype
        stepped = self.memory["optimizer"] * sympy.Rational(grads, states) if states else self.memory["grads"]
        return optimizer_step_bytes(self.memory["optimizer"], stepped)

    def steps(self, alpha=5e-6, beta=25e9, flops_per_s=1e12) -> dict:
        """Node -> one step of a lowering that runs in steps (ring attention: Lowering.steps):
        ``steps`` (how many), ``compute`` and ``shift`` seconds of one (forward + backward);
        both are in ``time()``'s ``compute`` and ``comm`` already (the runtime does not overlap
        them: a shift that took less than its step's compute could hide under it). Apart from
        ``time()``, whose values are all formulas (a notebook may turn each into a number)."""
        alpha, beta, fps = (
            sympy.Symbol(v, positive=True) if isinstance(v, str) else v for v in (alpha, beta, flops_per_s)
        )
        out = {}
        for node in self.plan.graph.nodes:
            lay = node.meta.get("autopar")
            found = lowering_for(lay.strategies) if lay is not None and lay.strategies else None
            got = found[0].steps(self.plan, node, found[1], self.sy) if found is not None else None
            if got:
                shift = alpha * got["messages"] + got["bytes"] / beta
                out[node.name] = {"steps": got["steps"], "compute": got["flops"] / fps, "shift": shift}
        return out

    def __str__(self) -> str:
        ex = ", ".join(f"{k}={v}" for k, v in self.example.items())
        num = self.at()
        lines = [f"per rank and step (example: {ex})"]
        for axis, e in self.comm.items():
            lines.append(f"  comm on {axis}: {e}  = {num['comm'][axis]:.0f} B")
        for k, e in self.memory.items():
            lines.append(f"  memory {k}: {e}  = {num['memory'][k]:.0f} B")
        lines.append(f"  flops: {self.flops}  = {num['flops']:.3g}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<autopar.Cost {dict(self.comm)}>"

    def _repr_latex_(self) -> str:
        rows = [rf"\text{{comm on {a} (B)}} & {sympy.latex(e)} \\" for a, e in self.comm.items()]
        rows += [rf"\text{{memory: {k} (B)}} & {sympy.latex(e)} \\" for k, e in self.memory.items()]
        rows.append(rf"\text{{FLOPs}} & {sympy.latex(self.flops)} \\")
        return r"$$\begin{array}{l|l}" + "\n".join(rows) + r"\end{array}$$"


def formula_of(comm) -> sympy.Expr:
    """A Comm's bytes formula; a Comm made without one (numbers only) counts as its number."""
    if comm.formula is not None:
        return comm.formula
    return sympy.Rational(comm.bytes).limit_denominator(10**6)


def _sum_by(comms, key) -> dict:
    out: dict = defaultdict(lambda: sympy.Integer(0))
    for c in comms:
        out[key(c)] += formula_of(c)
    return {k: simplify(v) for k, v in out.items()}


HOST_PARTS = ("offloaded",)  # terms in host memory (offloaded checkpoints): beside the device's total
STATE_PARTS = ("params", "grads", "optimizer", "accumulated", "gathered", "reduce_buffers")  # the rest: activations


# The parts each moment of a step holds beyond its base (memory_phases), in order; the base
# (parameters, optimizer state, accumulated gradients, padding, and any part not named here, an
# upper bound for what a technique adds) counts at every moment. The backward phase is the largest
# of its three moments. A linear table, so that the search's MILP can hold each row to the budget.
# A block's backward holds its recompute beside its gathered parameters; its reduce-scatter's
# buffers come at its end, its recompute freed (fsdp_runtime.reduce: the gathers' backward):
# measured, a 405B-width pipeline's stage 0 peaked inside a block's recompute with no reduce
# buffer alive, 2.2 GiB below their sum.
PHASE_ROWS = {
    "forward": ("compute_copies", "activations", "workspace", "gathered"),
    "backward": ("compute_copies", "activations", "recompute", "workspace", "backward", "outputs"),
    "backward, gathering": ("compute_copies", "activations", "recompute", "workspace", "gathered"),
    "backward, reducing": ("compute_copies", "activations", "workspace", "gathered", "reduce_buffers"),
    "optimizer": ("grads", "gathered", "reduce_buffers"),
}
_BASE = ("params", "optimizer", "optimizer_state", "accumulated", "padding")
_NAMED = set(_BASE).union(*PHASE_ROWS.values())


def phase_flags(plan) -> dict:
    """What memory_rows needs to know of ``plan``'s techniques beside the parts, as keywords: a
    pipeline's later micro-batches run backward beside the earlier ones' gradients
    (``grads_in_backward``); a storage keeps its gathered blocks from forward to backward
    (``gathered_in_backward``: the ``keeps_gathered`` hook, zero=3 not resharded)."""
    return {
        "grads_in_backward": plan.stage_layout is not None,
        "gathered_in_backward": any(t.keeps_gathered() for t in plan.options.techniques),
    }


def memory_rows(parts: dict, grads_in_backward: bool = False, gathered_in_backward: bool = False) -> dict:
    """Bytes a rank holds at each moment of PHASE_ROWS, from its memory parts (numbers or
    formulas): each row a sum of parts, so linear in them (the search's MILP holds each row to
    the budget; memory_phases takes the largest of the backward rows). ``gathered_in_backward``
    (``keeps_gathered``): the loss's backward holds the ``gathered`` blocks too (measured: a
    405B-width last pipeline stage, zero=3 not resharded, peaked at the loss's backward with its
    11.6 GiB of gathered blocks alive).

    Example:
        >>> memory_rows({"params": 2, "grads": 2, "optimizer_state": 4, "activations": 10})
        {'forward': 16, 'backward': 16, 'backward, gathering': 16, 'backward, reducing': 16, 'optimizer': 8}
    """
    g = lambda k: parts.get(k, 0)  # noqa: E731
    base = sum(g(k) for k in _BASE) + sum(v for k, v in parts.items() if k not in _NAMED)
    out = {}
    for row, names in PHASE_ROWS.items():
        held = base + sum(g(k) for k in names)
        if grads_in_backward and row != "optimizer":  # a pipeline's later micro-batches, beside earlier gradients
            held += g("grads")
        if gathered_in_backward and row == "backward":  # the blocks kept gathered since their forward
            held += g("gathered")
        out[row] = held
    return out


def memory_phases(parts: dict, grads_in_backward: bool = False, gathered_in_backward: bool = False) -> dict:
    """Bytes a rank holds at each phase of a step, from its memory parts (memory_per_rank's
    numbers or plan.cost()'s formulas, either naming of the optimizer's state): the step's peak
    is the largest (the headline: memory_per_rank(rank).peak, plan.cost()'s ``peak_memory``,
    ap.predict), not their sum, since no phase holds every part:

    - ``forward``: at the forward's end: the state (parameters, optimizer state, accumulated
      gradients, padding), a policy's compute copies, the activations, zero=3's gathered blocks;
    - ``backward``: from the loss's backward on, the activations with the largest of the loss's
      backward (``recompute + workspace + backward + outputs``), a block's recompute beside its
      gathered block, and, at the block's end, its recompute freed, the gathered blocks beside a
      reduce-scatter's buffers; no gradient yet (``zero_grad(set_to_none)`` freed them), except
      where a pipeline's micro-batches accumulate them (``grads_in_backward``);
    - ``optimizer``: backward's end and the step: the state and the gradients, the last bucket
      gathered and reducing; the activations gone.

    PHASE_ROWS lists each moment's parts. Measured against dry runs (LLaMA-3.1-8B FSDP 8: the
    peak at the loss's backward, 60.66 GiB measured, 60.62 by these phases, 66.82 by the parts'
    sum; docs/auto.md has the full-size rows). Parts not named there count in every phase (an
    upper bound for what a technique adds).

    Example:
        >>> memory_phases({"params": 2, "grads": 2, "optimizer_state": 4, "activations": 10})
        {'forward': 16, 'backward': 16, 'optimizer': 8}
    """
    rows = memory_rows(parts, grads_in_backward, gathered_in_backward)
    return {
        "forward": rows["forward"],
        "backward": _max(rows["backward"], _max(rows["backward, gathering"], rows["backward, reducing"])),
        "optimizer": rows["optimizer"],
    }


def _max(a, b):
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Max(a, b)
    return max(a, b)


def memory_formulas(plan, sy: PlanSymbols, optimizer_states: int = 2, rank: int = 0) -> dict:
    """Bytes ``rank`` holds at its step's peak, by part (formulas): the parts
    plan.memory_per_rank(rank) counts (parallel/dp_module.py has what each holds), so that
    their sums agree at the example.

    ``params`` / ``grads`` / ``optimizer``: of the parameters the rank holds (a pipeline rank:
    its stages', ``Technique.rank_params``), each in its dtype (a precision policy's fp32 masters),
    the optimizer's
    ``optimizer_states`` values per element in the parameter's dtype, as the techniques shard them
    (``Technique.memory_formulas``: ZeRO's shares, ZeRO-2's ``accumulated`` gradients over a
    pipeline's micro-batches, zero=3's ``gathered`` blocks); ``compute_copies``: a precision
    policy's ``param_dtype`` copies of the parameters read without a gather (``copy_bytes``);
    ``padding``: what the rank's ZeRO
    slices hold beyond those shares (buckets padded to a multiple of the group: a number); then
    the activation terms (``activation_terms``) of the rank; ``offloaded`` (host memory) too,
    which Cost keeps apart."""
    params = sympy.Integer(0)
    grads = sympy.Integer(0)
    opt = sympy.Integer(0)
    copies = sympy.Integer(0)
    dtype = copy_dtype(plan)
    held = {name for name, _ in named_parameters(plan.model)}
    for technique in plan.options.techniques:  # a pipeline rank holds its stages' parameters only
        held = technique.rank_params(plan, rank, held)
    for name, p in named_parameters(plan.model):
        if name not in held:
            continue
        local = sy.numel(p.shape, plan.param_specs.get(name))
        params += local * p.element_size()
        copies += copy_bytes(p, local, None if name in plan.traced.kept_fp32 else dtype)
        if p.requires_grad:
            grads += local * p.element_size()
            opt += optimizer_states * local * p.element_size()
    out = {"params": params, "grads": grads, "optimizer": opt}
    for technique in plan.options.techniques:  # ZeRO's shares, zero=3's gathered blocks, ...
        out = technique.memory_formulas(plan, sy, out, rank)
    if copies:
        out["compute_copies"] = copies
    padding, grads_padding = _padding(plan, sy, out, rank, optimizer_states)
    if padding:
        out["padding"] = padding
    if grads_padding:  # in the gradients' own part: they are alive at other phases than the state
        out["grads"] = out["grads"] + grads_padding
    out.update(activation_terms(plan, sy, rank))
    return {k: simplify(sympy.sympify(v)) for k, v in out.items()}


def _padding(plan, sy, state: dict, rank: int, optimizer_states: int) -> tuple:
    """What ``rank``'s stored state (plan.memory_per_rank: its buckets, each padded to a multiple
    of its group) holds beyond the formulas' even shares of it, at the example: (the state's
    padding, the gradients'), numbers; apart since the gradients are alive at other phases."""
    exact = plan.memory_per_rank(rank, optimizer_states)
    held = sum(exact.get(k, 0) for k in ("params", "optimizer_state", "accumulated", "gathered"))
    held += exact.get("reduce_buffers", 0)
    parts = [k for k in STATE_PARTS if k in state and k != "grads"]
    extra = held - float(sy.value(sum(state[k] for k in parts)))
    grads = exact.get("grads", 0) - float(sy.value(state.get("grads", 0)))
    return tuple(sympy.Float(e) if abs(e) > 1e-6 else 0 for e in (extra, grads))


def activation_terms(plan, sy, rank: int | None = None, whole_model: bool = False) -> dict:
    """``activations`` (and ``recompute`` under checkpointing, ``offloaded`` in host memory) as
    numbers or formulas of ``sy``, as the plan's techniques change them: what ap.predict and
    memory_per_rank add. Where a rank runs part of the model (pipeline stages), ``rank``'s share
    (None: the rank that holds the most); ``whole_model``: the whole model's at the whole batch
    (the search scales those by the techniques' step shares itself)."""
    out = {"activations": activation_bytes(plan, sy)}
    for technique in plan.options.techniques:  # activation checkpointing keeps fewer
        out = technique.activations(plan, sy, out)
    workspace = workspace_bytes(plan, sy)  # a lowered op's buffers while it runs (cp attention's)
    if not (isinstance(workspace, (int, float)) and workspace == 0):
        out["workspace"] = workspace
    if any(plan.ctx.needs_grad.values()):  # the loss's backward, where it outweighs the others
        held = out.get("recompute", 0) + out.get("workspace", 0)
        out["backward"] = _beyond(loss_backward_bytes(plan, sy), held, sy)
        dropped = dropped_outputs_bytes(plan, sy)  # outputs gathered at the forward's end, then dropped
        if sy.value(dropped) > sy.value(held + out["backward"]):
            out["outputs"] = _beyond(dropped, held + out["backward"], sy)
    if not whole_model:
        for technique in plan.options.techniques:  # a pipeline rank holds its stages' only
            out = technique.rank_activations(plan, sy, out, rank)
    return out


def _beyond(a, b, sy):
    """max(0, a - b): numbers, or a formula where ``sy`` makes formulas."""
    if isinstance(sy, Numbers):
        return max(0.0, float(a) - float(b))
    return sympy.Max(0, sympy.sympify(a) - sympy.sympify(b))


def largest_piece(node, sy: PlanSymbols) -> sympy.Expr:
    """How much more than an even share of ``node``'s work the busiest rank does: per axis where
    the op's split dims do not divide (every split dim of an op on one axis has the same size:
    propagate._uneven_ok), ceiling(N / n) / (N / n), the first ranks' rows over the average."""
    lay, f = layout_of(node), sympy.Integer(1)
    tensors = [(v, spec) for v, spec in zip([v for v in tensor_outputs(node) if v is not None], lay.outputs)]
    tensors += [(i.meta.get("val"), spec) for i, spec in zip(lay.inputs, lay.input_targets)]
    for axis in range(len(sy.axes)):
        for val, spec in tensors:
            p = spec[axis] if spec else None
            size = val.shape[p.dim] if isinstance(p, Shard) and isinstance(val, torch.Tensor) else None
            if size is not None and is_uneven(size, sy.mesh.shape[axis]):
                n = sy.axes[axis]
                f *= sympy.ceiling(sympy.Integer(int(size)) / n) * n / int(size)
                break
    return f


def flops_formula(plan, sy: PlanSymbols, rank: int | None = None) -> sympy.Expr:
    """FLOPs per rank and step: forward, plus twice that for ops whose output needs a gradient
    (attention: ATTENTION_BACKWARD times, flash's backward recomputing the scores), plus the
    forward once more for the ops activation checkpointing recomputes (``Technique.recomputed``:
    the kernels run again in backward, as compute_seconds charges them). A pipeline ``rank``
    runs its own stages' ops only, on every micro-batch: their FLOPs at the whole batch (None:
    every op). A dry run's FlopCounterMode counts the same (tests/simulated/test_dry_run_memory.py,
    test_dry_run_pipeline.py)."""
    recomputed = set().union(*(t.recomputed(plan) for t in plan.options.techniques))
    mine = stage_nodes(plan, rank)
    total = sympy.Integer(0)
    for node in plan.graph.nodes:
        if node.op != "call_function" or "autopar" not in node.meta or not layout_of(node).outputs:
            continue
        if mine is not None and node.name not in mine:
            continue
        f = node_flops(node, sy) / split_factor(layout_of(node).spec, sy) * largest_piece(node, sy)
        if not plan.ctx.needs_grad.get(node):
            total += f
            continue
        backward = ATTENTION_BACKWARD if op_work(node).kind == "attention" else 2
        total += f * (1 + backward + (1 if node.name in recomputed else 0))
    return simplify(total)


def stage_nodes(plan, rank: int | None) -> set | None:
    """The graph nodes pipeline ``rank``'s stages run (None: not a pipeline, or no rank: all)."""
    lay = plan.stage_layout
    if lay is None or rank is None:
        return None
    pos = plan.mesh.coords(rank)[lay.axis]
    return {n for st in lay.stages if lay.rank_of_stage(st.index) == pos for n in st.nodes}


def compute_seconds(plan, sy: PlanSymbols, flops_per_s, bandwidth=None, attention_flops_per_s=None) -> sympy.Expr:
    """Compute seconds per rank and step: each op's forward and, where its output needs a
    gradient, backward (op_time.node_seconds), the ops of checkpointed regions run forward once
    more; on the busiest rank where a split does not divide (``largest_piece``)."""
    recomputed = set().union(*(t.recomputed(plan) for t in plan.options.techniques))
    total = sympy.Integer(0)
    for node in plan.graph.nodes:
        if node.op != "call_function" or "autopar" not in node.meta or not layout_of(node).outputs:
            continue
        grad = bool(plan.ctx.needs_grad.get(node))
        fwd, bwd = node_seconds(node, sy, flops_per_s, bandwidth, grad, plan.ctx.needs_grad, attention_flops_per_s)
        again = fwd if grad and node.name in recomputed else 0
        total += (fwd + bwd + again) * largest_piece(node, sy)
    return total
