"""The layouts of ``autopar::float8_mm`` and its lowering: the scales' amax reductions.

The op is ``x @ w.T``, so it takes the Linear's strategies (rules/matmul.py) but the ones with a
Partial operand: a partial sum's amax is not the sum's, so the scale could not be the serial
one; such an operand is reduced first (propagation prices that). Every strategy carries the
lowering, which passes the op the groups of ranks to reduce each cast's amax over
(ops.py): for a tensorwise cast every axis that splits the tensor, for an axiswise one the axes
that split the dims the amax runs over (a row's amax over the in-features: the axis splitting
them, row-parallel's tp). The output gradient is split as the output is (a Partial output's
gradient is whole on every rank).

Tensorwise, two more strategies run tensor parallel's collective inside the op in fp8, as torchao's
float8 tensor parallel does under sequence parallelism (Float8TensorParallel): a column-parallel
Linear taking its input split on a leading dim (GATHER_INPUT: cast, then all-gathered as fp8
bytes) and a row-parallel one leaving its output split on a leading dim (SCATTER_OUTPUT: its output
reduce-scattered, its gradient cast and all-gathered in fp8). They price that collective for
propagation themselves (``strategy_bytes``), so they are chosen where the input arrives split (or
the output must leave split) and the fp8 gather moves fewer bytes than the compute dtype's.

Example (column-parallel fc1 on tp, batch on dp, tensorwise): the input's amax is reduced over
dp, the weight's over tp, the output gradient's over dp and tp.
"""

from __future__ import annotations

import operator
import weakref

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.runtime.ring import ring_bytes
from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.sharding.propagate import layout_of
from autopar.sharding.rules.matmul import BATCH_LABELS, einsum_strategies
from autopar.sharding.rules.registry import MATMUL, OpInfo, Strategy, register
from autopar.parallel.float8 import ops  # noqa: F401 - defines autopar::float8_mm
from autopar.parallel.float8.recipes import config
from autopar.parallel.param_names import canonical_names

F8 = torch.ops.autopar.float8_mm.default
ROLE_TENSOR = (0, 1, 2, 1, 2, 0)  # which tensor each cast reads: 0 input, 1 weight, 2 output (gradient)
AMAX_BYTES = 4  # the fp8 all-gather's amaxes: float32 (gather.py); a cast's amax is in its tensor's dtype


def _over(role: int, ndim: int, axiswise: bool) -> set:
    """The dims of its tensor that cast ``role``'s amax runs over (ops.py's roles)."""
    if not axiswise:
        return set(range(ndim))
    last, lead = {ndim - 1}, set(range(ndim - 1))
    return {0: last, 1: {1}, 2: last, 3: {0}, 4: lead, 5: lead}[role]


def _casts(recipe: str) -> list:
    c = config(recipe)
    return [
        c.cast_config_input,
        c.cast_config_weight,
        c.cast_config_grad_output,
        c.cast_config_weight_for_grad_input,
        c.cast_config_grad_output_for_grad_weight,
        c.cast_config_input_for_grad_weight,
    ]


def masks(node) -> list[int]:
    """Per mesh axis, the bits of the casts whose amax is reduced over it."""
    lay = layout_of(node)
    specs = [lay.input_targets[0], lay.input_targets[1], lay.spec]
    ndims = [node.args[0].meta["val"].dim(), 2, node.meta["val"].dim()]
    out = []
    for axis in range(len(lay.spec)):
        bits = 0
        for role, cast in enumerate(_casts(node.args[2])):
            t = ROLE_TENSOR[role]
            p = specs[t][axis]
            if cast.scaling_type.value == "disabled" or not isinstance(p, Shard):
                continue
            if p.dim % ndims[t] in _over(role, ndims[t], cast.scaling_granularity.value == "axiswise"):
                bits |= 1 << role
        out.append(bits)
    return out


def _amax_numel(node, role: int, symbols):
    """How many amaxes cast ``role`` reduces on one rank: 1 (tensorwise), or one per row or column
    of the rank's piece (axiswise: the dims the amax runs over become 1, the others stay split)."""
    cast = _casts(node.args[2])[role]
    if cast.scaling_granularity.value != "axiswise":
        return 1
    lay, t = layout_of(node), ROLE_TENSOR[role]
    tensor = (node.args[0], node.args[1], node)[t]
    spec = (lay.input_targets[0], lay.input_targets[1], lay.spec)[t]
    shape = list(tensor.meta["val"].shape)
    over = _over(role, len(shape), True)
    kept = [1 if d in over else s for d, s in enumerate(shape)]
    placed = tuple(Replicate() if isinstance(p, Shard) and p.dim % len(shape) in over else p for p in spec)
    return symbols.numel(kept, placed)


def _param_name(plan, node) -> str | None:
    """The canonical parameter name ``node`` (a placeholder) reads, or None."""
    fqn = plan.traced.param_fqn.get(node.name) if node.op == "placeholder" else None
    return None if fqn is None else canonical_names(plan).get(fqn, fqn)


def _concat(*groups) -> list:
    return [r for g in groups for r in g]


def tp_pairs(node) -> tuple[list, list]:
    """([(mesh axis, dim)] on which float8_mm gathers its input in fp8, [(mesh axis, dim)] on which it
    reduce-scatters its output): its strategies with the tensor-parallel float8 lowerings."""
    gather, scatter = [], []
    for a, s in enumerate(layout_of(node).strategies or ()):
        if s is not None and s.lowering is GATHER_INPUT:
            gather.append((a, s.inputs[0].dim))
        elif s is not None and s.lowering is SCATTER_OUTPUT:
            scatter.append((a, s.outputs[0].dim))
    return gather, scatter


def _flat(pairs, axes) -> list[int]:
    """(mesh axis, dim) pairs as float8_mm's [position in its groups, dim, ...]."""
    return [v for a, d in pairs for v in (axes.index(a), d)]


_GATHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # emitter -> {key: gather node}


class Float8Scales(Lowering):
    name = "float8_scales"
    priority = 10
    uneven = True  # a max over pieces of any size
    ragged = True

    def emit(self, em, node, args, kwargs, axis: int):
        bits = masks(node)
        axes = [a for a, b in enumerate(bits) if b]
        groups = em.graph.call_function(_concat, tuple(em.rank_value(f"autopar_group_{a}") for a in axes))
        sizes = [em.mesh.shape[a] for a in axes]
        rank = em.rank_value("autopar_rank")
        mbits = [bits[a] for a in axes]
        gather, scatter = tp_pairs(node)
        if not gather and not scatter:
            return em.graph.call_function(F8, (args[0], args[1], args[2], groups, sizes, mbits, rank))
        x, x8, x_scale = args[0], None, None
        if gather:  # one fp8 gather of an input several Linears read (q, k, v), as PrepareFloat8ModuleInput
            key = (args[0], tuple(gather), tuple(b & 1 for b in bits))
            memo = _GATHERS.setdefault(em, {})
            if key not in memo:
                op = torch.ops.autopar.float8_gather_input.default
                g = em.graph.call_function(op, (args[0], args[2], groups, sizes, mbits, rank, _flat(gather, axes)))
                memo[key] = tuple(em.graph.call_function(operator.getitem, (g, i)) for i in range(3))
            x, x8, x_scale = memo[key]
        f8_args = (x, args[1], args[2], groups, sizes, mbits, rank, None, None, x8, x_scale, _flat(scatter, axes))
        return em.graph.call_function(F8, f8_args)

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        """One all-reduce (max) of each reduced amax, on every axis that reduces it: one value in the
        tensor's dtype per tensor (tensorwise) or per row / column of the rank's piece (axiswise);
        none for a weight zero=3 gathers in fp8 (its scale is gather.py's). Where tensor parallel
        gathers the input in fp8: that gather (1 byte per element; its backward a reduce-scatter in the
        compute dtype) and the input's amax, listed at the first Linear reading it, and no cast of the
        input for grad_weight (the gathered one is reused). Where it reduce-scatters the output: that
        reduce-scatter (compute dtype), its backward's fp8 all-gather of the output gradient, and one
        cast of that gradient for both gemms."""
        out = []  # every axis's reductions (the lowering is emitted once, for all axes)
        f8 = plan.options.float8
        wired = f8 is not None and _param_name(plan, node.args[1]) in f8.gather_wire(plan)
        gather, scatter = tp_pairs(node)
        skip = ({1, 3} if wired else set()) | ({0, 5} if gather else set()) | ({4} if scatter else set())
        bits = masks(node)
        for a, b in enumerate(bits):
            for role in range(6):
                if role in skip or not b >> role & 1:
                    continue
                out.append(self._amax_comm(node, role, a, symbols))
        if gather and _first_reader(plan, node, gather, bits):
            out += [self._amax_comm(node, 0, a, symbols) for a, b in enumerate(bits) if b & 1]
            x = node.args[0]
            item = x.meta["val"].dtype.itemsize
            local = symbols.local_bytes(x, layout_of(node).input_targets[0])
            for a, _ in gather:
                n = symbols.axes[a]
                out.append(("all_gather", a, "forward", ring_bytes("all_gather", local / item, n)))
                local = local * n
            if plan.ctx.needs_grad.get(x):
                for a, _ in reversed(gather):
                    n = symbols.axes[a]
                    out.append(("reduce_scatter", a, "backward", ring_bytes("reduce_scatter", local, n)))
                    local = local / n
        if scatter:
            item = node.meta["val"].dtype.itemsize
            full = symbols.local_bytes(node, layout_of(node).spec)
            for a, _ in scatter:
                full = full * symbols.axes[a]
            local = full
            for a, _ in reversed(scatter):
                n = symbols.axes[a]
                out.append(("reduce_scatter", a, "forward", ring_bytes("reduce_scatter", local, n)))
                local = local / n
            local = local / item  # the gradient's piece in fp8: 1 byte per element
            for a, _ in scatter:
                n = symbols.axes[a]
                out.append(("all_gather", a, "backward", ring_bytes("all_gather", local, n)))
                local = local * n
        return out

    @staticmethod
    def _amax_comm(node, role: int, a: int, symbols) -> tuple:
        phase = "forward" if role < 2 else "backward"
        tensor = (node.args[0], node.args[1], node)[ROLE_TENSOR[role]]
        # torchao's amax is in the tensor's dtype (tensor_to_amax): 2 bytes under a bf16 policy
        size = tensor.meta["val"].dtype.itemsize * _amax_numel(node, role, symbols)
        return ("all_reduce", a, phase, ring_bytes("all_reduce", size, symbols.axes[a]))

    def reason(self, axis_name: str) -> str:
        return f"float8 scales: the amax of each cast split on {axis_name} is all-reduced (max) so every rank scales as serial"


def _first_reader(plan, node, gather, bits) -> bool:
    """Whether ``node`` is the first float8_mm to read its input through this fp8 gather (the one
    the program runs for all of them: Float8Scales.emit's memo)."""
    key = (tuple(gather), tuple(b & 1 for b in bits))
    for other in plan.graph.nodes:
        if other.target is F8 and other.args[0] is node.args[0]:
            if (tuple(tp_pairs(other)[0]), tuple(b & 1 for b in masks(other))) == key:
                return other is node
    return True


class Float8TensorParallel(Float8Scales):
    """A float8 Linear that runs tensor parallel's collective itself, in fp8, as torchao's float8
    tensor parallel does (tensorwise only, as torchao): GATHER_INPUT takes its input split on a
    sequence (or batch) dim and all-gathers it as fp8 bytes, cast with the whole input's scale
    (Float8ColwiseParallel, PrepareFloat8ModuleInput); SCATTER_OUTPUT reduce-scatters its output
    on such a dim and its backward all-gathers the output gradient in fp8 (Float8RowwiseParallel).
    Values are the serial ones bit for bit: the casts are elementwise with the whole tensor's scale."""

    priority = 11  # emitted for every axis (Float8Scales.emit reads the strategies of all)
    uneven = False  # an all-gather of equal pieces
    ragged = False

    def __init__(self, name: str, gathers: bool):
        self.name, self.gathers = name, gathers

    def strategy_bytes(self, info, s, axis: int, cur, mesh, grads) -> float:
        """What propagation weighs beside the edges (sharding/propagate.py's _cost): the collective
        the op runs on ``axis``, forward (fp8 for the input's gather, compute dtype for the output's
        reduce-scatter) and backward where a gradient flows (compute dtype for the input gradient's
        reduce-scatter, fp8 for the output gradient's gather). Sizes on the other axes as the
        input's current split (a batch split on dp splits the output's rows too)."""
        meta = info.tensors[0] if self.gathers else info.outputs[0]
        n, numel = mesh.shape[axis], 1
        for d in meta.shape:
            numel *= d
        for a, p in enumerate(cur[0]):
            if a != axis and isinstance(p, Shard):
                numel /= mesh.shape[a]
        full = numel * meta.dtype.itemsize  # the tensor whole on this axis
        fwd, bwd = (numel, full) if self.gathers else (full, numel)  # fp8: one byte per element
        grad = grads[0] if self.gathers else any(grads)
        return (n - 1) / n * (fwd + (bwd if grad else 0.0))

    def reason(self, axis_name: str) -> str:
        what = "gathers the input" if self.gathers else "reduce-scatters the output (its gradient gathered)"
        return f"float8 tensor parallel: the Linear {what} on {axis_name} in fp8, scaled as serial"


FLOAT8_SCALES = register_lowering(Float8Scales())
GATHER_INPUT = register_lowering(Float8TensorParallel("float8_gather_input", gathers=True))
SCATTER_OUTPUT = register_lowering(Float8TensorParallel("float8_scatter_output", gathers=False))


@register(F8, work=MATMUL)
def float8_mm_rule(op: OpInfo) -> list[Strategy]:
    """The Linear's strategies without a Partial operand, each with the scales' lowering; for the
    tensorwise recipe also torchao's float8 tensor parallel (Float8TensorParallel): column-parallel
    with the input split on a leading dim (gathered in fp8), row-parallel with the output split on
    one (reduce-scattered, its gradient gathered in fp8)."""
    x = op.tensors[0]
    batch = BATCH_LABELS[: x.ndim - 1]
    out = []
    for s in einsum_strategies(op, batch + "k", "nk", batch + "n"):
        if not any(isinstance(p, Partial) for p in s.inputs):
            out.append(Strategy(s.inputs, s.outputs, FLOAT8_SCALES, s.note or "float8"))
    if op.arg(2, "recipe") == "tensorwise" and len(op.tensors) == 2:
        w, last = op.tensors[1], x.ndim - 1
        for d in range(last):
            if x.shape[d] == 1:
                continue
            if w.shape[0] != 1:
                note = "float8 tp: input gathered in fp8"
                out.append(Strategy((Shard(d), Shard(0)), (Shard(last),), GATHER_INPUT, note))
            if w.shape[1] != 1:
                note = "float8 tp: output reduce-scattered, its gradient gathered in fp8"
                out.append(Strategy((Shard(last), Shard(1)), (Shard(d),), SCATTER_OUTPUT, note))
    return out
