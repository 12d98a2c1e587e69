"""Tensor parallel (and its data-parallel product), simulated: per-rank modules against the
serial model (forward, every gradient, parameters after one SGD step) for the MLP and the GPT on
tp2, tp4, dp2xtp2 (the MLP also on dp-only meshes); and plan.check can fail."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar as ap
from tests.harness.meshes import MESHES, TP
from tests.harness.models import MLP, MLP_TP, gpt_batch, gpt_plan
from tests.harness.serial import assert_params_close, sgd_step

MLP_MESHES = [*TP, "dp4", "dp8"]


@pytest.mark.parametrize("name", MLP_MESHES)
def test_mlp_matches_serial(name):
    spec = MESHES[name]
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    ann = MLP_TP if "tp" in spec.axes else {}
    plan = ap.plan(model, spec.mesh(), args=(x,), annotations=ann, data_parallel=spec.dp)
    report = plan.check(x)
    assert report["grads"] == len(list(model.parameters()))
    plan.check(torch.randn(16, 16))  # another batch size: dims are dynamic


@pytest.mark.parametrize("name", TP)
@pytest.mark.parametrize("tied", [True, False])
def test_gpt_matches_serial(name, tied):
    idx, tg = gpt_batch()
    plan = gpt_plan(name, tied=tied)
    plan.check(idx, tg)
    plan.check(*gpt_batch(batch=4, seq=12, seed=5))  # other batch and sequence length


@pytest.mark.parametrize("name", TP)
def test_gpt_parameters_after_one_sgd_step(name):
    idx, tg = gpt_batch()
    plan = gpt_plan(name)
    serial = copy.deepcopy(plan.model)
    losses = plan.simulate(lambda m, *a: _train(m, a), idx, tg)
    _, serial_loss = serial(idx, tg)
    sgd_step(serial, 0.5, serial_loss)
    merged = plan.merge_state_dicts([dict(plan.module(r).named_parameters()) for r in range(plan.mesh.size)])
    assert_params_close(merged, dict(serial.named_parameters()), name, rtol=1e-5, atol=1e-6)
    for loss in losses:  # every rank reports the global loss
        assert abs(loss - serial_loss.item()) < 1e-5


def _train(module, args):
    _, loss = module(*args)
    sgd_step(module, 0.5, loss)
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


class _ReplicatedPlusAveraged(torch.nn.Module):
    """A replicated value (after a row-parallel layer) added to a partial average (a mean over
    a split dim): the plan lifts the replicated one to P(avg), whose gradient must be whole."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).split(8, -1)
        y = q * k + v
        return self.proj(y).sum() + y.mean(-1).sum()


@pytest.mark.parametrize("shape", [(2,), (4,)])
def test_replicated_plus_partial_average_gradients(shape):
    torch.manual_seed(0)
    model, x = _ReplicatedPlusAveraged(), torch.randn(4, 8)
    plan = ap.plan(
        model,
        ap.Mesh(shape, ("tp",)),
        args=(x,),
        annotations={"qkv": ap.colwise("tp", blocks=3), "proj": ap.rowwise("tp")},
    )
    assert "to_partial" in plan.module(0).code and "'avg'" in plan.module(0).code
    plan.check(x)
