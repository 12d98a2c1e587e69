"""The layouts of ``autopar::float8_mm`` and its lowering: the scales' amax reductions.

The op is ``x @ w.T``, so it takes the Linear's strategies (rules/matmul.py) but the ones with a
Partial operand: a partial sum's amax is not the sum's, so the scale could not be the serial
one; such an operand is reduced first (propagation prices that). Every strategy carries the
lowering, which passes the op the groups of ranks to reduce each cast's amax over
(ops.py): for a tensorwise cast every axis that splits the tensor, for an axiswise one the axes
that split the dims the amax runs over (a row's amax over the in-features: the axis splitting
them, row-parallel's tp). The output gradient is split as the output is (a Partial output's
gradient is whole on every rank).

Example (column-parallel fc1 on tp, batch on dp, tensorwise): the input's amax is reduced over
dp, the weight's over tp, the output gradient's over dp and tp.
"""

from __future__ import annotations

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
        return em.graph.call_function(F8, (args[0], args[1], args[2], groups, sizes, [bits[a] for a in axes], rank))

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        """One all-reduce (max) of each reduced amax, on every axis that reduces it: one value in the
        tensor's dtype per tensor (tensorwise) or per row / column of the rank's piece (axiswise);
        none for a weight zero=3 gathers in fp8 (its scale is gather.py's)."""
        out = []  # every axis's reductions (the lowering is emitted once, for all axes)
        f8 = plan.options.float8
        wired = f8 is not None and _param_name(plan, node.args[1]) in f8.gather_wire(plan)
        for a, b in enumerate(masks(node)):
            for role in range(6):
                if wired and role in (1, 3):
                    continue  # gathered in fp8 with its scale (gather.py): no cast, no reduction here
                if b >> role & 1:
                    phase = "forward" if role < 2 else "backward"
                    tensor = (node.args[0], node.args[1], node)[ROLE_TENSOR[role]]
                    # torchao's amax is in the tensor's dtype (tensor_to_amax): 2 bytes under a bf16 policy
                    size = tensor.meta["val"].dtype.itemsize * _amax_numel(node, role, symbols)
                    out.append(("all_reduce", a, phase, ring_bytes("all_reduce", size, symbols.axes[a])))
        return out

    def reason(self, axis_name: str) -> str:
        return f"float8 scales: the amax of each cast split on {axis_name} is all-reduced (max) so every rank scales as serial"


FLOAT8_SCALES = register_lowering(Float8Scales())


@register(F8, work=MATMUL)
def float8_mm_rule(op: OpInfo) -> list[Strategy]:
    """The Linear's strategies without a Partial operand, each with the scales' lowering."""
    batch = BATCH_LABELS[: op.tensors[0].ndim - 1]
    out = []
    for s in einsum_strategies(op, batch + "k", "nk", batch + "n"):
        if not any(isinstance(p, Partial) for p in s.inputs):
            out.append(Strategy(s.inputs, s.outputs, FLOAT8_SCALES, s.note or "float8"))
    return out
