"""ap.clip_grad_norm_ against serial torch.nn.utils.clip_grad_norm_: the total norm on every
rank, and the parameters after one clipped SGD step, on dp / tp / (dp, tp), ZeRO-1/2,
a pipeline and norm_type=inf (simulated; real gloo in test_clip_gloo.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks
from tests.harness.meshes import MESHES
from tests.harness.models import MEGATRON, MLP, MLP_TP, gpt_batch, small_gpt

# ZeRO shards over a dp axis: the tp-only mesh runs without it
CASES = [(mesh, zero) for mesh in ("dp2", "tp4", "dp2xtp2") for zero in (0, 1, 2) if zero == 0 or MESHES[mesh].dp]
LR = 0.5


def loss_of(out):
    return out.sin().square().mean() + out.mean()


def serial_clipped(model, x, max_norm, norm_type):
    """(total norm, parameters after one clipped SGD step) of the serial model."""
    serial = copy.deepcopy(model)
    loss_of(serial(x)).backward()
    total = torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm, norm_type)
    with torch.no_grad():
        for p in serial.parameters():
            p -= LR * p.grad
    return total, dict(serial.named_parameters())


def ranks_clipped(plan, x, max_norm, norm_type, zero):
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]
    opt_of = (
        (lambda m: ap.ZeroOptimizer(m, torch.optim.SGD, lr=LR))
        if zero
        else (lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    )
    opts = [opt_of(m) for m in modules]
    inputs = [plan.local_inputs(r, x)[0] for r in plan.mesh.ranks()]

    def step(r):
        loss_of(modules[r](*inputs[r])).backward()
        total = ap.clip_grad_norm_(modules[r], max_norm, norm_type)
        opts[r].step()
        return total

    totals = run_ranks(plan.mesh.size, step)
    params = plan.merge_state_dicts([dict(m.named_parameters()) for m in modules])
    return totals, params


@pytest.mark.parametrize("mesh,zero", CASES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_matches_serial(mesh, zero, norm_type):
    shape, axes = MESHES[mesh].shape, MESHES[mesh].axes
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    dp = ap.DataParallel("dp", zero=zero, bucket_max_params=3) if "dp" in axes else None
    plan = ap.plan(model, ap.Mesh(shape, axes), args=(x,), annotations=MLP_TP if "tp" in axes else {}, data_parallel=dp)
    full, _ = serial_clipped(model, x, 1e9, norm_type)
    max_norm = 0.3 * float(full)  # clipping really scales
    s_total, s_params = serial_clipped(model, x, max_norm, norm_type)
    totals, params = ranks_clipped(plan, x, max_norm, norm_type, zero)
    for t in totals:  # the same value on every rank, bit for bit
        assert torch.equal(t, totals[0])
    torch.testing.assert_close(totals[0], s_total, rtol=1e-5, atol=1e-7)
    for name, p in s_params.items():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_torch_clip_is_not_enough():
    """The bug this exists for: torch's clip on a tp rank sees only its pieces."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations=MLP_TP)
    full, _ = serial_clipped(model, x, 1e9, 2.0)

    def step(m, xl):
        loss_of(m(xl)).backward()
        return torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)

    naive = plan.simulate(step, x)
    assert not any(torch.allclose(n, full, rtol=1e-3) for n in naive)


def test_clip_pipeline_norm_over_all_stages():
    model = small_gpt(layers=4)
    batch = gpt_batch(batch=8)
    plan = ap.plan(
        model,
        ap.Mesh((2, 2), ("pp", "tp")),
        args=batch,
        annotations=MEGATRON,
        pipeline=ap.Pipeline("pp", microbatches=2),
    )
    serial = copy.deepcopy(model)
    serial(*batch)[1].backward()
    full = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
    s_total = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.5 * float(full))
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]

    def step(r):
        runners[r].step(batch)
        return ap.clip_grad_norm_(runners[r], 0.5 * float(full))

    totals = run_ranks(plan.mesh.size, step)
    for t in totals:
        torch.testing.assert_close(t, s_total, rtol=1e-5, atol=1e-7)
    for r in runners:  # tied wte/lm_head on both stages: each holder scaled once, equal to serial
        for name, p in r.named_parameters():
            sp = serial.get_parameter(name).grad
            got = p.grad
            spec = plan.param_specs[name]
            ref = ap.placement.shard_tensor(sp, spec, plan.mesh, r.rank) if hasattr(ap, "placement") else sp
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)


def test_clip_refuses_plain_module_and_no_sync():
    with pytest.raises(ap.PlanError, match="torch.nn.utils.clip_grad_norm_"):
        ap.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp")

    def step(m, xl):
        with m.no_sync():
            loss_of(m(xl)).backward()
            ap.clip_grad_norm_(m, 1.0)

    with pytest.raises(ap.SimulationError, match="no_sync"):
        plan.simulate(step, x)
