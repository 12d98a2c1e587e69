"""ap.opaque(): an untraceable submodule kept as one replicated op, trained with exact gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from tests.harness.meshes import MESHES, TP


class Gate(nn.Module):
    """Branches on tensor values: torch.export cannot trace this."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        y = self.fc(x)
        if y.abs().sum() > 0:  # data-dependent
            return torch.tanh(y) * self.scale, y.mean(-1)
        return y, y.mean(-1)


class Net(nn.Module):
    def __init__(self, d=8, hidden=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.gate = Gate(d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc2(F.relu(self.fc1(x)))
        g, m = self.gate(h)
        return self.head(g) + m.unsqueeze(-1)


ANN = {"fc1": ap.colwise("tp"), "fc2": ap.rowwise("tp"), "gate": ap.opaque(), "head": ap.colwise("tp")}


def test_untraceable_submodule_fails_without_opaque():
    with pytest.raises(ap.TraceError, match="data-dependent"):
        ap.plan(Net(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 3, 8),))


@pytest.mark.parametrize("mesh_name", TP)
def test_opaque_submodule_matches_serial_forward_and_gradients(mesh_name):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 3, 8)
    plan = ap.plan(model, MESHES[mesh_name].mesh(), args=(x,), annotations=ANN, data_parallel=MESHES[mesh_name].dp)
    ops = [n for n in plan.graph.nodes if n.target is torch.ops.autopar.opaque_call.default]
    assert len(ops) == 1 and plan.param_specs["gate.fc.weight"] == (ap.Replicate(),) * len(MESHES[mesh_name].shape)
    report = plan.check(x)
    assert report["grads"] == 9  # gate.fc.weight/bias and gate.scale among them


def test_opaque_pattern_must_match():
    with pytest.raises(ap.AnnotationError, match="'gat' matches no submodule.*'gate'"):
        ap.plan(Net(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 3, 8),), annotations={"gat": ap.opaque()})


def test_opaque_trains_like_serial():
    """Three SGD steps, simulated, equal serial training (the opaque params included)."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 3, 8)
    serial = Net()
    serial.load_state_dict(model.state_dict())
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations=ANN)

    def step(module, x):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            module(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach() for n, p in module.named_parameters()}

    merged = plan.merge_state_dicts(plan.simulate(step, x))
    opt = torch.optim.SGD(serial.parameters(), lr=0.1)
    for _ in range(3):
        serial(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for n, p in serial.named_parameters():
        torch.testing.assert_close(merged[n], p.detach(), rtol=1e-5, atol=1e-6)


def test_consistency_signature_ignores_local_ops():
    """The debug check compares collectives only: opaque calls' keys may differ between ranks."""
    from autopar.runtime.consistency import collective_sequence

    torch.manual_seed(0)
    plan = ap.plan(Net(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 3, 8),), annotations=ANN)
    seq = collective_sequence(plan.module(0))
    assert seq and all(
        kind in ("all_reduce", "all_gather", "grad_all_reduce", "reduce_scatter", "all_to_all", "shard", "to_partial")
        for kind, _, _ in seq
    )
    assert all(group == (0, 1) for _, group, _ in seq)
