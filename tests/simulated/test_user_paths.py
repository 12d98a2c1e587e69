"""Issue 32's user paths (simulated): what a training loop does after set-up and across ranks
that must not drift apart. Freezing a parameter after planning, batch-norm buffers under data
parallelism, the loss contract with per-rank sequence lengths."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks
from tests.harness import data_parallel as H

ZEROS = [0, 1, 2, 3]


# ------------------------------------------------------------ freezing after planning
def _frozen_after_planning(mesh_name, zero, freeze="layers.0.fc1.weight", steps=2):
    """Plan, then freeze ``freeze`` on every rank's module (as fine-tuning code does after
    set-up); AdamW with weight decay. Each rank's (grad is None, params after steps)."""
    plan = H.make_plan(mesh_name).with_data_parallel(ap.DataParallel("dp", zero=zero, bucket_max_params=3))

    def step(rank):
        module = plan.build_module(rank)
        module.get_parameter(freeze).requires_grad_(False)
        cls, kw = torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = ap.ZeroOptimizer(module, cls, **kw) if zero in (1, 2) else cls(params, **kw)
        no_grad = True
        for x in H.batches(steps):
            H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
            no_grad = no_grad and module.get_parameter(freeze).grad is None
            opt.step()
            opt.zero_grad()
        return no_grad, {n: p.detach().clone() for n, p in module.named_parameters()}

    results = run_ranks(plan.mesh.size, step)
    return plan, [r[0] for r in results], plan.merge_state_dicts([r[1] for r in results])


@pytest.mark.parametrize("mesh_name", ["dp2", "dp2xtp2"])
@pytest.mark.parametrize("zero", ZEROS)
def test_parameter_frozen_after_planning_is_not_moved(mesh_name, zero):
    """The frozen weight keeps ``grad is None`` on every rank and does not move (AdamW's weight
    decay moved it by 0.0025 before); the others train as the serial model with it frozen."""
    name = "layers.0.fc1.weight"
    plan, no_grads, merged = _frozen_after_planning(mesh_name, zero, name)
    assert all(no_grads), no_grads
    serial = H.make_model()
    before = serial.get_parameter(name).detach().clone()
    serial.get_parameter(name).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in serial.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    for x in H.batches(2):
        H.loss_of(serial(x)).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(merged[name], before)
    for n, p in serial.named_parameters():
        torch.testing.assert_close(merged[n], p.detach(), rtol=1e-4, atol=1e-5, msg=n)
