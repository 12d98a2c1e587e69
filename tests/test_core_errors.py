"""Bad input gets an ap.PlanError subclass naming the module or node and the fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.placement import Shard
from tests.models import MLP, MLP_TP


def mlp_plan(mesh, annotations=MLP_TP, x=None, **kw):
    torch.manual_seed(0)
    return ap.plan(MLP(), mesh, args=(torch.randn(8, 16) if x is None else x,), annotations=annotations, **kw)


def test_indivisible_parameter_dim_names_parameter_and_fix():
    with pytest.raises(ap.ShardingError, match=r"layers.0.fc1.weight.*size 32.*does not divide by the size 3"):
        mlp_plan(ap.Mesh((3,), ("tp",)))


def test_unknown_axis_in_annotation():
    with pytest.raises(ap.MeshError, match=r"Unknown mesh axis 'pt'.*Did you mean 'tp'"):
        mlp_plan(ap.Mesh((2,), ("tp",)), {"layers.*.fc1": ap.colwise("pt")})


def test_pattern_matching_nothing_names_close_matches():
    with pytest.raises(ap.AnnotationError, match=r"'layers.\*.fc3' matches no module path.*'layers.0.fc1'"):
        mlp_plan(ap.Mesh((2,), ("tp",)), {"layers.*.fc3": ap.colwise("tp")})


def test_unknown_data_parallel_axis():
    with pytest.raises(ap.MeshError, match="Unknown mesh axis 'data'"):
        mlp_plan(ap.Mesh((2,), ("dp",)), {}, data_parallel="data")


def test_batch_not_divisible_by_dp_at_local_inputs():
    plan = mlp_plan(ap.Mesh((4,), ("dp",)), {}, data_parallel="dp")
    with pytest.raises(ap.InputError, match=r"Input 'x' has shape \(6, 16\).*multiple of 4"):
        plan.local_inputs(0, torch.randn(6, 16))


def test_rank_outside_mesh():
    plan = mlp_plan(ap.Mesh((2,), ("tp",)))
    with pytest.raises(ap.MeshError, match="Rank 2 is outside the mesh"):
        plan.module(2)


class Flip(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.flip(x * self.w, [0]).cumprod(0)


def test_op_without_rule_strict_names_op_and_module():
    x = torch.randn(8, 4)
    with pytest.raises(ap.NoRuleError, match=r"aten.flip.default at node 'flip'.*S\(0\)"):
        ap.plan(Flip(), ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp", strict=True)


def test_op_without_rule_falls_back_correctly_with_warning():
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match="no sharding rule for aten.flip.default"):
        plan = ap.plan(Flip(), ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp")
    plan.check(x)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # branches on a value: torch.export cannot trace this
            return self.fc(x)
        return x


def test_untraceable_model_says_where():
    with pytest.raises(ap.TraceError, match=r"test_core_errors.py:\d+.*data-dependent"):
        ap.plan(DataDependent(), ap.Mesh((2,), ("dp",)), args=(torch.randn(4, 4),))


def test_place_needs_one_placement_per_axis():
    with pytest.raises(ap.AnnotationError, match="gives 1 placements but the mesh"):
        mlp_plan(ap.Mesh((2, 2), ("dp", "tp")), {"x": ap.place(Shard(0))})


def test_conflicting_annotations():
    with pytest.raises(ap.AnnotationError, match="Conflicting annotations for 'layers.0.fc1.weight'"):
        mlp_plan(ap.Mesh((2,), ("tp",)), {"layers.*.fc1": ap.colwise("tp"), "layers.0.fc1": ap.rowwise("tp")})
