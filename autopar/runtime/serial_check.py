"""Plan.check: every rank, simulated, against the serial model; outputs and every gradient.

The objective differentiated is the model's own output when it is a scalar loss, the
``loss`` callable applied to the outputs when given, and otherwise a fixed random weighting
of every floating output (a plain sum would hide a permuted gradient). Per rank it is taken
on the rank's slice of the outputs: data-parallel slices average to the serial mean, as
in DDP.

Example:
    >>> plan.check(x)                       # returns {'outputs': 2, 'grads': 17, 'max_rel': 3e-7}
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

from autopar.parallel import dp_module as dpplan
from autopar.errors import PlanMismatch
from autopar.placement import shard_tensor


def _weights(plan, outputs, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    flat = pytree.tree_leaves(outputs)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype) if _float(o) and o.dim() else None
            for o in flat]


def _float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point


def _objective(outputs, weights):
    total = 0.0
    for o, w in zip(pytree.tree_leaves(outputs), weights):
        if not _float(o):
            continue
        total = total + (o.sum() if w is None else (o * w).mean())
    return total


def check_plan(plan, args, kwargs, loss, rtol, atol) -> dict:
    model = plan.model
    params = {n: p.detach().clone().requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}  # one name per tied tensor
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    serial_out = functional_call(model, {**params, **buffers}, args, kwargs, tie_weights=True)
    weights = _weights(plan, serial_out)
    serial_obj = loss(serial_out) if loss is not None else _objective(serial_out, weights)
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    grads = torch.autograd.grad(serial_obj, list(trainable.values()), allow_unused=True) \
        if trainable and serial_obj.requires_grad else [None] * len(trainable)
    serial_grads = dict(zip(trainable, grads))

    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    plan = dpplan.exact_gradients(plan)  # ZeRO / local SGD / reduce dtype: check the full fp32 sums
    modules = [plan.build_module(r, state) for r in plan.mesh.ranks()]
    inputs = [plan.local_inputs(r, *args, **kwargs) for r in plan.mesh.ranks()]
    local_weights = [[None if w is None else shard_tensor(w, s, plan.mesh, r)
                      for w, s in zip(weights, plan.output_specs)] for r in plan.mesh.ranks()]

    def step(rank):
        a, k = inputs[rank]
        out = modules[rank](*a, **k)
        obj = loss(out) if loss is not None else _objective(out, local_weights[rank])
        if torch.is_tensor(obj) and obj.requires_grad:  # a model without trainable parameters has none
            obj.backward()
        g = {n: p.grad for n, p in modules[rank].named_parameters(remove_duplicate=False)}
        return out, g

    from autopar.runtime.simulator import run_ranks
    results = run_ranks(plan.mesh.size, step)
    merged_out = plan.merge_outputs([r[0] for r in results])
    worst = 0.0
    for i, (s, m) in enumerate(zip(pytree.tree_leaves(serial_out), pytree.tree_leaves(merged_out))):
        if isinstance(s, torch.Tensor):
            worst = max(worst, _compare(f"output {i}", s.detach(), m, rtol, atol))
    per_rank_grads = [r[1] for r in results]
    merged_grads = plan.merge_state_dicts([{n: g[n] for n in serial_grads if n in g}
                                           for g in per_rank_grads])
    for name, sg in serial_grads.items():
        mg = merged_grads.get(name)
        if sg is None and mg is None:
            continue
        if sg is None:
            sg = torch.zeros_like(mg)
        if mg is None:
            raise PlanMismatch(f"gradient of {name!r}: the serial model has one, the ranks have none.")
        worst = max(worst, _compare(f"gradient of {name!r}", sg, mg, rtol, atol))
    return {"outputs": len(pytree.tree_leaves(serial_out)), "grads": len(serial_grads), "max_rel": worst}


def _compare(what: str, serial: torch.Tensor, merged: torch.Tensor, rtol: float, atol: float) -> float:
    if serial.shape != merged.shape:
        raise PlanMismatch(f"{what}: serial shape {tuple(serial.shape)}, ranks give {tuple(merged.shape)}.")
    if serial.dtype.is_floating_point:
        diff = (serial - merged).abs()
        bad = diff > atol + rtol * serial.abs()
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise PlanMismatch(
                f"{what} differs from serial: max |diff| {diff.max().item():.3g} (rtol {rtol}, atol {atol}); "
                f"first at index {idx}: serial {serial[idx].item():.6g}, ranks {merged[idx].item():.6g}.")
        scale = serial.abs().max().item() or 1.0
        return diff.max().item() / scale
    if not torch.equal(serial, merged):
        raise PlanMismatch(f"{what} differs from serial (integer values).")
    return 0.0
