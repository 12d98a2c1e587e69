"""Plan.check: every rank, simulated, against the serial model; outputs and every gradient.

The objective differentiated is the model's own output when it is a scalar loss, the
``loss`` callable applied to the outputs when given, and otherwise a fixed random weighting
of every floating output (a plain sum would hide a permuted gradient). Per rank it is taken
on the rank's slice of the outputs: data-parallel slices average to the serial mean, as
in DDP.

Tolerances default to the model's lowest floating precision (``TOLERANCES``): a bf16
model is checked at bf16 tolerances without hand-set ``rtol``/``atol``. They scale with each
tensor: an element may differ by ``rtol`` of itself plus ``rtol`` of the tensor's largest
magnitude (``atol`` at least), since a sum taken in another order is off by rounding of its
terms, not of its result. ``max_rel`` is each
tensor's largest difference over its own largest magnitude, floored at ``rtol`` times the
largest magnitude of its kind in the model (all outputs, or all gradients): a gradient that is
zero in exact arithmetic carries rounding noise of the model's scale, not of its own, and
must not read as a relative error near or above 1.

Example:
    >>> plan.check(x)                       # returns {'outputs': 2, 'grads': 17, 'max_rel': 3e-7, ...}
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

from autopar.errors import PlanMismatch
from autopar.placement import shard_tensor
from autopar.runtime import rng
from autopar.runtime.simulator import run_ranks


# dtype -> (rtol, atol) that plan.check uses unless given: summing in another order (which is
# what splitting a reduction over ranks does) moves a result by a few units in the last place.
TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def default_tolerances(model, rtol=None, atol=None) -> tuple[float, float]:
    """(rtol, atol) for ``model``: the loosest entry of TOLERANCES over its floating tensors."""
    dtypes = {t.dtype for t in (*model.parameters(), *model.buffers()) if t.dtype.is_floating_point}
    table = [TOLERANCES[d] for d in dtypes if d in TOLERANCES] or [TOLERANCES[torch.float32]]
    return (max(r for r, _ in table) if rtol is None else rtol, max(a for _, a in table) if atol is None else atol)


def _weights(plan, outputs, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    flat = pytree.tree_leaves(outputs)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype) if _float(o) and o.dim() else None for o in flat]


def _float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point


def _objective(outputs, weights):
    total = 0.0
    for o, w in zip(pytree.tree_leaves(outputs), weights):
        if not _float(o):
            continue
        total = total + (o.sum() if w is None else (o * w).mean())
    return total


def _serial_reference(plan, args, kwargs, loss) -> tuple:
    """The serial model's outputs, objective weights, parameter gradients and the gradients of the
    inputs that require grad (by flat input position)."""
    model = plan.model
    params = {
        n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in model.named_parameters()
    }  # one name per tied tensor
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    flat_in, in_tree = pytree.tree_flatten((args, kwargs))
    leaves = [_grad_leaf(v) for v in flat_in]  # inputs that require grad: their own leaves
    s_args, s_kwargs = pytree.tree_unflatten(leaves, in_tree)
    with torch.random.fork_rng(devices=[]):  # seeded alike with the ranks (rng="serial"), the caller's RNG untouched
        torch.manual_seed(CHECK_SEED)
        serial_out = functional_call(model, {**params, **buffers}, s_args, s_kwargs, tie_weights=True)
    weights = _weights(plan, serial_out)
    serial_obj = loss(serial_out) if loss is not None else _objective(serial_out, weights)
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    # the ranks' input gradients equal the serial ones: a batch-split output's gradient is
    # scaled by 1/dp on each rank (emit.py), so every rank differentiates its share of the serial objective
    wanted = [i for i, v in enumerate(leaves) if _requires_grad(v)]
    grads = _grads(serial_obj, [*trainable.values(), *(leaves[i] for i in wanted)])
    return (
        serial_out,
        weights,
        dict(zip(trainable, grads[: len(trainable)])),
        dict(zip(wanted, grads[len(trainable) :])),
    )


def check_plan(plan, args, kwargs, loss, rtol, atol) -> dict:
    model = plan.model
    serial_out, weights, serial_grads, serial_in_grads = _serial_reference(plan, args, kwargs, loss)
    flat_in, in_tree = pytree.tree_flatten((args, kwargs))
    wanted = list(serial_in_grads)
    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    plan = plan.with_exact_gradients()  # ZeRO / local SGD / reduce dtype: check the full fp32 sums
    modules = [plan.build_module(r, state) for r in plan.mesh.ranks()]
    for m in modules:  # every rank's generator where check seeded the serial model (rng="serial": its draws)
        if hasattr(m, rng.STATE):
            getattr(m, rng.STATE).copy_(rng.initial_state(CHECK_SEED))
    inputs = [_local_leaves(plan, r, flat_in, in_tree) for r in plan.mesh.ranks()]
    local_weights = [
        [None if w is None else shard_tensor(w, s, plan.mesh, r) for w, s in zip(weights, plan.output_specs)]
        for r in plan.mesh.ranks()
    ]

    def step(rank):
        a, k = inputs[rank]
        out = modules[rank](*a, **k)
        obj = loss(out) if loss is not None else _objective(out, local_weights[rank])
        if torch.is_tensor(obj) and obj.requires_grad:  # a model without trainable parameters has none
            obj.backward()
        g = {n: p.grad for n, p in modules[rank].named_parameters(remove_duplicate=False)}
        flat = pytree.tree_leaves((a, k))
        return out, g, {i: flat[i].grad for i in wanted}

    results = run_ranks(plan.mesh.size, step)
    with _randomness_named(plan, random_nodes(plan)):
        worst_out = _compare_outputs(plan, serial_out, [r[0] for r in results], rtol, atol)
        worst_grad = _compare_param_grads(plan, serial_grads, [r[1] for r in results], rtol, atol)
        worst_in = _compare_input_grads(plan, serial_in_grads, [r[2] for r in results], rtol, atol)
    return {
        "outputs": len(pytree.tree_leaves(serial_out)),
        "grads": len(serial_grads),
        "input_grads": len(serial_in_grads),
        "max_rel": max(worst_out, worst_grad, worst_in),
        "rtol": rtol,
        "atol": atol,
    }


def _requires_grad(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.requires_grad


def _grad_leaf(v):
    """A serial leaf for an input that requires grad (so its gradient can be read), else ``v``."""
    return v.detach().clone().requires_grad_() if _requires_grad(v) else v


def _grads(objective, tensors: list) -> list:
    if not tensors or not (torch.is_tensor(objective) and objective.requires_grad):
        return [None] * len(tensors)
    return list(torch.autograd.grad(objective, tensors, allow_unused=True))


def _local_leaves(plan, rank: int, flat_in: list, in_tree) -> tuple:
    """``rank``'s (args, kwargs), each piece of an input that requires grad a leaf of its own."""
    args, kwargs = pytree.tree_unflatten(flat_in, in_tree)
    a, k = plan.local_inputs(rank, *args, **kwargs)
    flat, tree = pytree.tree_flatten((a, k))
    flat = [p.detach().clone().requires_grad_() if _requires_grad(v) else p for p, v in zip(flat, flat_in)]
    return pytree.tree_unflatten(flat, tree)


def _compare_outputs(plan, serial_out, rank_outs: list, rtol, atol) -> float:
    """Every rank's outputs against its piece of the serial ones (a replicated output on every rank)."""
    serial = pytree.tree_leaves(serial_out)
    items = []
    for rank, out in enumerate(rank_outs):
        for i, (s, m, spec) in enumerate(zip(serial, pytree.tree_leaves(out), plan.output_specs)):
            if isinstance(s, torch.Tensor):
                piece = s.detach() if spec is None else shard_tensor(s.detach(), spec, plan.mesh, rank)
                items.append((f"output {i} on rank {rank}", piece, m.detach(), s))
    return _compare_pieces(items, rtol, atol)


def _compare_param_grads(plan, serial_grads: dict, per_rank: list, rtol, atol) -> float:
    merged_grads = plan.merge_state_dicts([{n: g[n] for n in serial_grads if n in g} for g in per_rank])
    grads = []
    for name, sg in serial_grads.items():
        mg = merged_grads.get(name)
        if sg is None and mg is None:
            continue
        if sg is None:
            sg = torch.zeros_like(mg)
        if mg is None:
            raise PlanMismatch(f"gradient of {name!r}: the serial model has one, the ranks have none.")
        grads.append((f"gradient of {name!r}", sg, mg))
    return _compare_all(grads, rtol, atol)


def _compare_input_grads(plan, serial: dict, per_rank: list, rtol, atol) -> float:
    """Every rank's gradient of every input that requires grad against its piece of the serial
    one: a replicated input's gradient must be whole on every rank, a split one its slice."""
    names = plan.traced.user_inputs
    items = []
    for i, sg in serial.items():
        spec = plan.input_specs[i]
        for rank, grads in enumerate(per_rank):
            mg = grads[i]
            if sg is None and mg is None:
                continue
            what = f"gradient of input {names[i]!r} on rank {rank}"
            if mg is None:
                raise PlanMismatch(f"{what}: the serial model has one, the rank has none.")
            full = torch.zeros_like(mg) if sg is None else sg
            piece = full if sg is None or spec is None else shard_tensor(sg, spec, plan.mesh, rank)
            items.append((what, piece, mg, full))
    return _compare_pieces(items, rtol, atol)


def _compare_pieces(items, rtol: float, atol: float) -> float:
    """(what, serial piece, rank's piece, whole serial tensor): the floor from the whole tensors."""
    floor = rtol * max((_magnitude(full) for *_, full in items), default=0.0)
    return max((_compare(what, s, m, rtol, atol, floor, _magnitude(full)) for what, s, m, full in items), default=0.0)


CHECK_SEED = 1234  # the serial model and every rank draw from torch.manual_seed(CHECK_SEED)'s state


def random_nodes(plan) -> list[str]:
    """The nodes that draw random numbers when the model runs in the mode it is in: ops torch
    tags ``nondeterministic_seeded``, less dropouts with p = 0 or off in eval mode and attention
    without dropout."""
    out = []
    for node in plan.graph.nodes:
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
            continue
        where = _DROP_P.get(node.target.overloadpacket)
        if where is not None:
            p = node.args[where[0]] if len(node.args) > where[0] else node.kwargs.get(where[1], 0.0)
            if not p or not plan.model.training:
                continue
        out.append(node.name)
    return out


_aten = torch.ops.aten
# ops that draw only with a dropout probability > 0 in training: (its position, its name)
_DROP_P = {
    op: (1, "p")
    for op in (_aten.dropout, _aten.feature_dropout, _aten.alpha_dropout, _aten.feature_alpha_dropout)
    + (_aten.dropout_, _aten.feature_dropout_, _aten.alpha_dropout_, _aten.feature_alpha_dropout_)
}
_DROP_P[_aten.scaled_dot_product_attention] = (4, "dropout_p")


@contextlib.contextmanager
def _randomness_named(plan, drawing: list[str]):
    """A mismatch of a model that draws random numbers says so, and what makes check exact."""
    try:
        yield
    except PlanMismatch as e:
        if not drawing:
            raise
        if plan.options.rng == "serial":
            why = (
                "rng='serial' draws the serial model's numbers on CPU (check seeds both alike), so "
                "randomness should not be the cause unless these run in a pipeline or on CUDA"
            )
        else:
            why = (
                "rng='placement' draws them differently from the serial model by design (the same on "
                "replicas, not the serial values): plan with rng='serial' to check them against serial, "
                "or check in eval mode (model.eval() before planning)"
            )
        shown = ", ".join(drawing[:6]) + (" ..." if len(drawing) > 6 else "")
        raise PlanMismatch(f"{e} The model draws random numbers ({shown}): {why}.") from e


def _magnitude(t: torch.Tensor) -> float:
    return t.detach().abs().max().item() if t.dtype.is_floating_point and t.numel() else 0.0


def _compare_all(items, rtol: float, atol: float) -> float:
    """Compare (what, serial, merged) triples; the worst error, each floored at the kind's scale."""
    floor = rtol * max((_magnitude(s) for _, s, _ in items), default=0.0)
    return max((_compare(what, s, m, rtol, atol, floor) for what, s, m in items), default=0.0)


def _compare(
    what: str,
    serial: torch.Tensor,
    merged: torch.Tensor,
    rtol: float,
    atol: float,
    floor: float = 0.0,
    whole: float | None = None,
) -> float:
    """The largest difference over the tensor's scale; PlanMismatch where an element differs by more
    than ``rtol`` of itself plus ``atol`` or ``rtol`` of the largest magnitude of the whole tensor
    (``whole``: of the serial tensor a piece is cut from; None: of ``serial``)."""
    if serial.shape != merged.shape:
        raise PlanMismatch(f"{what}: serial shape {tuple(serial.shape)}, ranks give {tuple(merged.shape)}.")
    if serial.dtype.is_floating_point or serial.is_complex():
        wide = torch.complex128 if serial.is_complex() else torch.float64  # complex: |difference|
        diff = (serial.to(wide) - merged.to(wide)).abs()
        # an element summed in another order is off by rounding of its terms, which are of the
        # tensor's scale: a logit near 0 beside logits of 37 may be 4e-6 off (fp32's unit at 37)
        near = max(atol, rtol * (whole if whole is not None else _magnitude(serial)))
        bad = diff > near + rtol * serial.to(wide).abs()
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise PlanMismatch(
                f"{what} differs from serial: max |diff| {diff.max().item():.3g} (rtol {rtol} of each element, "
                f"plus {near:.3g}: atol {atol} or rtol times the tensor's largest magnitude); "
                f"first at index {idx}: serial {serial[idx].item():.6g}, ranks {merged[idx].item():.6g}."
            )
        scale = max(_magnitude(serial), floor) or 1.0
        return diff.max().item() / scale if diff.numel() else 0.0
    if not torch.equal(serial, merged):
        raise PlanMismatch(f"{what} differs from serial (integer values).")
    return 0.0
