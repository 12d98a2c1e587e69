"""The fuzzer's clipping mode: ap.clip_grad_norm_ against serial torch.nn.utils.clip_grad_norm_.

For a planned case: plan.check's objective (a fixed random weighting of the outputs),
backward on every simulated rank, ap.clip_grad_norm_ at half the serial norm (so it really
clips), then the total norm (the same on every rank) and the merged clipped gradients must
equal serial's. Raises AssertionError on a wrong number.

Example:
    >>> check_clipping(plan, args)
"""

from __future__ import annotations

import copy

import torch

import autopar as ap
from autopar.runtime.serial_check import _objective, _weights
from autopar.placement import shard_tensor
from autopar.runtime import rng
from autopar.runtime.simulator import run_ranks

SEED = 1234


def check_clipping(plan, args, rtol=1e-4, atol=1e-5) -> None:
    serial = copy.deepcopy(plan.model)
    with torch.random.fork_rng(devices=[]):  # random ops (rng="serial"): both sides draw from SEED
        torch.manual_seed(SEED)
        out = serial(*args)
    weights = _weights(plan, out)  # plan.check's objective: per rank it sums to serial's
    objective = _objective(out, weights)
    if not objective.requires_grad:
        return  # nothing to clip (a model without trainable parameters)
    objective.backward()
    params = [p for p in serial.parameters() if p.grad is not None]
    if not params:
        return
    full = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    max_norm = 0.5 * full + 1e-12
    s_total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]
    inputs = [plan.local_inputs(r, *args) for r in plan.mesh.ranks()]
    local_w = [
        [None if w is None else shard_tensor(w, s, plan.mesh, r) for w, s in zip(weights, plan.output_specs)]
        for r in plan.mesh.ranks()
    ]

    for m in modules:
        if hasattr(m, rng.STATE):
            ap.manual_seed(m, SEED)

    def step(r):
        a, k = inputs[r]
        _objective(modules[r](*a, **k), local_w[r]).backward()
        return ap.clip_grad_norm_(modules[r], max_norm)

    totals = run_ranks(plan.mesh.size, step)
    assert all(torch.equal(t, totals[0]) for t in totals), f"ranks disagree on the norm: {totals}"
    torch.testing.assert_close(totals[0], s_total, rtol=rtol, atol=atol)
    grads = plan.merge_state_dicts(
        [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in modules]
    )
    for name, p in serial.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=rtol, atol=atol, msg=f"clipped grad {name}")
