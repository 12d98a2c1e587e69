"""Simulated numerics: per-rank modules against the serial model (forward, every gradient,
parameters after one SGD step) for an MLP and the GPT-style model on several meshes."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar as ap
from tests.models import MESHES, MLP, MLP_TP, gpt_batch, mesh_and_plan, small_gpt

MLP_MESHES = {
    "tp2": ((2,), ("tp",), None),
    "tp4": ((4,), ("tp",), None),
    "dp2xtp2": ((2, 2), ("dp", "tp"), "dp"),
    "dp4": ((4,), ("dp",), "dp"),
    "dp8": ((8,), ("dp",), "dp"),
}


@pytest.mark.parametrize("name", list(MLP_MESHES))
def test_mlp_matches_serial(name):
    shape, axes, dp = MLP_MESHES[name]
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    ann = MLP_TP if "tp" in axes else {}
    plan = ap.plan(model, ap.Mesh(shape, axes), args=(x,), annotations=ann, data_parallel=dp)
    report = plan.check(x)
    assert report["grads"] == len(list(model.parameters()))
    plan.check(torch.randn(16, 16))  # another batch size: dims are dynamic


@pytest.mark.parametrize("name", list(MESHES))
@pytest.mark.parametrize("tied", [True, False])
def test_gpt_matches_serial(name, tied):
    model = small_gpt(tied=tied)
    idx, tg = gpt_batch()
    plan = mesh_and_plan(name, model, (idx, tg))
    plan.check(idx, tg)
    plan.check(*gpt_batch(batch=4, seq=12, seed=5))  # other batch and sequence length


def _sgd_step(module, lr, loss):
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


@pytest.mark.parametrize("name", list(MESHES))
def test_gpt_parameters_after_one_sgd_step(name):
    model = small_gpt()
    serial = copy.deepcopy(model)
    idx, tg = gpt_batch()
    plan = mesh_and_plan(name, model, (idx, tg))
    losses = plan.simulate(lambda m, *a: _train(m, a), idx, tg)
    _, serial_loss = serial(idx, tg)
    _sgd_step(serial, 0.5, serial_loss)
    merged = plan.merge_state_dicts([dict(plan.module(r).named_parameters()) for r in range(plan.mesh.size)])
    for n, p in serial.named_parameters():
        torch.testing.assert_close(merged[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
    for loss in losses:  # every rank reports the global loss
        assert abs(loss - serial_loss.item()) < 1e-5


def _train(module, args):
    _, loss = module(*args)
    _sgd_step(module, 0.5, loss)
    return loss.item()


def test_check_reports_a_wrong_plan():
    """Plan.check must be able to fail: break one rank's weight and expect PlanMismatch."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations=MLP_TP)
    original = plan.build_module

    def broken(rank, state=None):
        gm = original(rank, state)
        if rank == 1:
            with torch.no_grad():
                gm.get_parameter("layers.0.fc1.weight").add_(0.1)
        return gm
    plan.build_module = broken
    with pytest.raises(ap.PlanMismatch, match="output 0"):
        plan.check(x)


def test_loss_callable_in_check():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(x,), annotations=MLP_TP, data_parallel="dp")
    plan.check(x, loss=lambda out: out.pow(2).mean())
