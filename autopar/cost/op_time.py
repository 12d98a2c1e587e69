"""One op's work and its seconds on a device: FLOPs, the bytes it moves, and a roofline.

An op takes the longer of its FLOPs at the device's compute rate and the bytes it reads and
writes at the device's memory bandwidth (``roofline``): matmuls and attention at LLaMA sizes are
bound by their FLOPs, norms, RoPE, SwiGLU's products, residual adds, casts and copies by their
bytes (one FLOP per output element against two or more bytes). A profile without a bandwidth
counts FLOPs only (the CPU's ``cpu-gloo``, whose rate is a measured step's).

Bytes, per rank: what the op's kernels read and write, as eager PyTorch runs it. Each op
signature (op, sizes, dtypes, which inputs need a gradient) is run once on the meta device,
forward and then backward, under a dispatch mode that adds up every kernel's tensor inputs and
outputs (views, aliases and allocations move nothing): a norm's ``pow`` backward is three kernels
(``pow``, ``mul``, ``mul``), a broadcast ``mul``'s backward two products and a reduction. Those
bytes, as a multiple of the op's own inputs + outputs at the traced sizes, scale the rank's
local inputs + outputs (a piece runs the same kernels on less). Matmuls and attention (flash
kernels: never the L x S scores the meta device's math path would make) and an op that does not
run on meta count inputs + outputs forward and ``outputs + 2 x inputs`` backward. A cast to the
dtype a tensor has, or ``contiguous`` of a contiguous tensor, returns its input: no bytes.
FLOPs: see ``node_flops``; backward twice the forward.

Example:
    >>> fwd, bwd = node_seconds(node, Numbers(plan.mesh), 676e12, 3.35e12, grad=True)
    >>> roofline(4096.0, 8 * 2**20, 676e12, 3.35e12)       # bytes-bound: 2.5e-06 s
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.cost.formulas import Numbers
from autopar.sharding.propagate import layout_of, tensor_outputs
from autopar.sharding.rules import VIEW, Work, op_traits

aten = torch.ops.aten
# ops that return their input itself when it is already what they make
MAY_ALIAS = {aten.to.dtype, aten.to.dtype_layout, aten.to.other, aten.to.device, aten.type_as.default}
CONTIGUOUS = {aten.contiguous.default}
ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default}


def op_work(node) -> Work:
    """The work ``node``'s op does, as its rule file declared it (sharding/rules/registry.py)."""
    return op_traits(node.target).work


def node_flops(node, sy) -> sympy.Expr:
    """Global forward FLOPs of one op by the work its rule file declares: matmuls 2*M*N*K,
    attention 4*L*S*D per head (half of it causal: the kernels skip the blocks above the
    diagonal, and bench/gpu_calibration.py's measured rates count it so), MoE experts
    2*T*k*(one expert's weights: the op's own ``Work.flops``), views none, anything else one per output element."""
    work = op_work(node)
    outs = [v for v in tensor_outputs(node) if v is not None]
    if work is VIEW or not outs:
        return sympy.Integer(0)
    out_numel = sy.numel(outs[0].shape)
    if work.kind == "matmul":
        a = node.args[work.lhs_arg]
        return 2 * out_numel * sy.dim(a.meta["val"].shape[-1])
    if work.kind == "attention":
        q, key = node.args[0].meta["val"], node.args[1].meta["val"]
        full = 4 * sy.numel(q.shape) * sy.dim(key.shape[-2])
        return full / 2 if is_causal(node) else full
    if work.flops is not None:  # a kind its rule file counts (MoE experts: parallel/experts/moe_rule.py)
        return work.flops(node, sy)
    return out_numel


# Backward FLOPs of attention over its forward's: flash attention's backward recomputes the scores
# (Q K^T) and then forms dP, dV, dQ and dK, five products of the forward's size against its two
# (torch.utils.flop_counter's sdpa_backward_flop_count counts the same five). The FLOP count
# (plan.cost()'s ``flops``) uses it; the time model keeps backward = 2 x forward, the convention
# the calibrated attention rates (search/profiles.py) were measured in.
ATTENTION_BACKWARD = 2.5


def is_causal(node) -> bool:
    """An attention op called with ``is_causal=True`` (where its schema puts the argument: the
    kernels export may leave take it at different positions)."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "is_causal" not in names:
        return False
    i = names.index("is_causal")
    return bool(node.args[i] if len(node.args) > i else node.kwargs.get("is_causal", False))


def split_factor(spec, sy) -> sympy.Expr:
    """How many ranks share one op's work: the axes on which its output is not replicated."""
    f = 1  # an int with numbers' axes (the search's hot path), a formula with symbols
    for axis, p in enumerate(spec or ()):
        if not p.is_replicate():
            f *= sy.axes[axis]
    return f


def node_bytes(node, sy, needs_grad=None) -> tuple:
    """(forward, backward) bytes ``node``'s kernels move on one rank (the module docstring);
    ``needs_grad``: node -> whether it needs a gradient (the plan's ``ctx.needs_grad``; None: every
    floating input does). (0, 0) for a view or an op that returns its input."""
    if op_work(node) is VIEW or _returns_input(node):
        return 0, 0
    lay = layout_of(node)
    ins, seen = 0, set()
    for i, spec in zip(lay.inputs, lay.input_targets):
        val = i.meta.get("val")
        if i in seen or not isinstance(val, torch.Tensor):
            continue
        seen.add(i)
        ins = ins + sy.numel(val.shape, spec) * val.dtype.itemsize
    outs = 0
    for val, spec in zip(tensor_outputs(node), lay.outputs):
        if val is not None:
            outs = outs + sy.numel(val.shape, spec) * val.dtype.itemsize
    ratios = None if op_work(node).kind != "elementwise" else kernel_ratios(node, needs_grad)
    if ratios is None:
        return ins + outs, outs + 2 * ins
    return ratios[0] * (ins + outs), ratios[1] * (ins + outs)


_KERNELS: dict = {}  # op signature -> (forward, backward) kernel bytes over the op's inputs + outputs


def kernel_ratios(node, needs_grad=None) -> tuple | None:
    """(forward, backward) bytes of ``node``'s eager kernels as multiples of its inputs' and
    outputs' bytes, run once per signature on the meta device; None where the op does not run
    there."""
    grads = tuple(bool(needs_grad.get(a, False)) if needs_grad is not None else None for a in _tensor_inputs(node))
    mine = node.meta.setdefault("autopar_kernels", {})  # copies of the graph (the search's probes) share it
    if grads not in mine:
        key = (node.target, _signature(node), grads)
        if key not in _KERNELS:
            _KERNELS[key] = _run_kernels(node, grads)
        mine[grads] = _KERNELS[key]
    return mine[grads]


def _run_kernels(node, grads) -> tuple | None:
    made = {}
    for a, g in zip(_tensor_inputs(node), grads):
        v = a.meta["val"]
        t = torch.empty([_hint(d) for d in v.shape], dtype=v.dtype, device="meta")
        made[a] = t.requires_grad_(v.dtype.is_floating_point and g is not False)

    def conv(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return made[a] if a in made else (_hint(v) if isinstance(v, torch.SymInt) else v)
        return a

    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), conv)
    try:
        with _KernelBytes() as fwd:
            out = node.target(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        own = sum(_nbytes(t) for t in [*made.values(), *outs])
        wanting = [t for t in made.values() if t.requires_grad]
        back = [o for o in outs if o.requires_grad]
        bwd = _KernelBytes()
        if wanting and back:
            seeds = [torch.empty_like(o) for o in back]
            with bwd:
                torch.autograd.grad(back, wanting, seeds, allow_unused=True)
    except Exception:  # an op that does not run on meta: the plain count
        return None
    return (fwd.bytes / own, bwd.bytes / own) if own else None


class _KernelBytes(TorchDispatchMode):
    """Adds up the bytes every kernel reads and writes (its tensor inputs and outputs); a view
    or alias (its schema says its output aliases an input) and an allocation move none."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        if not aliases and func not in ALLOCATIONS:
            tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(_nbytes(t) for t in tensors)
        return out


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches of ``t``: its elements, at most its storage (an expanded tensor)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _tensor_inputs(node) -> list:
    return list(dict.fromkeys(a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)))


def _signature(node):
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(_hint(d) for d in v.shape), v.dtype)
            return ("N", _hint(v) if isinstance(v, torch.SymInt) else repr(v))
        return repr(a)

    flat = pytree.tree_leaves((node.args, node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
    return tuple(sig(a) for a in flat)


def _hint(s) -> int:
    return int(s.node.hint) if isinstance(s, torch.SymInt) else int(s)


def _returns_input(node) -> bool:
    val = node.meta.get("val")
    src = node.args[0] if node.args else None
    sval = src.meta.get("val") if hasattr(src, "meta") else None
    if not isinstance(val, torch.Tensor) or not isinstance(sval, torch.Tensor):
        return False
    if node.target in MAY_ALIAS:
        return val.dtype == sval.dtype and val.device == sval.device
    return node.target in CONTIGUOUS and sval.is_contiguous()


def roofline(flops, nbytes, flops_per_s, bandwidth=None):
    """Seconds of an op: its FLOPs at ``flops_per_s`` or its bytes at ``bandwidth`` (B/s),
    whichever takes longer; FLOPs only without a bandwidth. Numbers or sympy formulas."""
    compute = flops / flops_per_s
    if bandwidth is None:
        return compute
    moved = nbytes / bandwidth
    if isinstance(compute, (int, float)) and isinstance(moved, (int, float)):
        return max(compute, moved)
    return sympy.Max(compute, moved)


def node_seconds(
    node, sy, flops_per_s, bandwidth=None, grad=False, needs_grad=None, attention_flops_per_s=None, nbytes=None
):
    """(forward, backward) seconds of ``node`` on one rank (backward 0 without a gradient):
    its local FLOPs (``node_flops`` over the ranks that share it; backward twice) at
    ``flops_per_s`` (attention at ``attention_flops_per_s`` where given) and its bytes
    (``node_bytes``, or ``nbytes``: (forward, backward) given, a fused region's share) at
    ``bandwidth``, through ``roofline``."""
    flops = node_flops(node, sy) / split_factor(layout_of(node).spec, sy)
    if bandwidth is None:
        fwd_b, bwd_b = 0, 0
    else:
        fwd_b, bwd_b = node_bytes(node, sy, needs_grad) if nbytes is None else nbytes
    if isinstance(sy, Numbers):
        flops, fwd_b, bwd_b = float(flops), float(fwd_b), float(bwd_b)
    rate = attention_flops_per_s if attention_flops_per_s and op_work(node).kind == "attention" else flops_per_s
    forward = roofline(flops, fwd_b, rate, bandwidth)
    return forward, (roofline(2 * flops, bwd_b, rate, bandwidth) if grad else 0)


def optimizer_step_bytes(state_bytes, grad_bytes):
    """Bytes an elementwise optimizer step moves for the parameters a rank steps: each state
    tensor read and written (``state_bytes``: all of them), each parameter read and written and
    its gradient read (the parameters are the gradients' size): 2 x states + 3 x gradients. A
    fused kernel's count (one pass); torch's foreach Adam makes a few more passes."""
    return 2 * state_bytes + 3 * grad_bytes
