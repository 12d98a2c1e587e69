"""Ops without a sharding rule: gathered and replicated (warned, correct), or NoRuleError with strict."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from tests.harness.meshes import MESHES, TP


class Mixer(nn.Module):
    def forward(self, h):
        return torch.renorm(h, 2, 0, 1.0) * h  # renorm has no rule (flip and roll have had one since issue 31)


class Net(nn.Module):
    def __init__(self, d=8, hidden=16):
        super().__init__()
        self.fc1, self.mix, self.fc2 = nn.Linear(d, hidden), Mixer(), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.relu(self.mix(self.fc1(x))))


ANN = {"fc1": ap.colwise("tp"), "fc2": ap.rowwise("tp")}


@pytest.mark.parametrize("mesh_name", TP)
def test_no_rule_gathers_warns_and_matches_serial(mesh_name):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = ap.plan(model, MESHES[mesh_name].mesh(), args=(x,), annotations=ANN, data_parallel=MESHES[mesh_name].dp)
    texts = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert any("aten.renorm" in t and "module 'mix'" in t and "bytes of communication" in t for t in texts), texts
    assert any(plan.layout(n.name).fallback for n in plan.graph.nodes if "autopar" in n.meta)
    plan.check(x)


def test_strict_raises_no_rule_error_naming_op_node_and_fix():
    with pytest.raises(ap.NoRuleError, match=r"aten\.renorm.*node 'renorm'.*module 'mix'.*S\(2\).*strict=False"):
        ap.plan(Net(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 3, 8),), annotations=ANN, strict=True)


def test_no_rule_on_replicated_inputs_is_silent():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = ap.plan(Net(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 3, 8),))
    assert not [w for w in caught if "no sharding rule" in str(w.message)]
    plan.check(torch.randn(4, 3, 8))
