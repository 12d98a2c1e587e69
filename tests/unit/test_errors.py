"""The error catalogue: every bad input gets an ap.PlanError subclass naming the culprit (module,
parameter, node, input) and the fix. One harness: the MLP of tests.harness.models, planned by
``mlp`` (d=8, for word checks with ``raises``) or ``mlp_plan`` (d=16, for regex matches)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.placement import Shard
from tests.harness.models import MLP, MLP_TP

X = torch.randn(4, 8)
TP2 = ap.Mesh((2,), ("tp",))
DPTP = ap.Mesh((2, 2), ("dp", "tp"))


def mlp(hidden=16):
    torch.manual_seed(0)
    return MLP(d=8, hidden=hidden, layers=1)


def mlp_plan(mesh, annotations=MLP_TP, x=None, **kw):
    torch.manual_seed(0)
    return ap.plan(MLP(), mesh, args=(torch.randn(8, 16) if x is None else x,), annotations=annotations, **kw)


def raises(kind, *words):
    """pytest.raises that also checks every word appears in the message."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(kind)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.ctx.__exit__(*exc)
            msg = str(self.info.value)
            missing = [w for w in words if w not in msg]
            assert not missing, f"{missing} not in message: {msg}"
            assert isinstance(self.info.value, ap.PlanError)
            return out

    return _Check()


def test_indivisible_parameter_dim_is_cut_unevenly():
    """18 rows on tp=4 are pieces 5, 5, 4, 4 (issue 24), not an error."""
    plan = ap.plan(
        mlp(hidden=18),
        ap.Mesh((4,), ("tp",)),
        args=(X,),
        annotations={"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")},
    )
    assert [plan.module(r).get_parameter("layers.0.fc1.weight").shape[0] for r in range(4)] == [5, 5, 4, 4]


def test_blocks_that_do_not_divide_name_the_tensor_and_axis():
    with raises(ap.ShardingError, "'layers.0.fc1.weight'", "blocks", "'tp'"):
        ap.plan(
            mlp(),
            ap.Mesh((4,), ("tp",)),
            args=(X,),
            annotations={"layers.0.fc1.weight": ap.place(ap.Shard(0, blocks=3))},
        )


def test_unknown_axis_lists_the_mesh_axes():
    with raises(ap.MeshError, "'tpp'", "('tp',)", "Did you mean 'tp'"):
        ap.plan(mlp(), TP2, args=(X,), annotations={"layers.0.fc1": ap.colwise("tpp")})
    with raises(ap.MeshError, "'model'"):
        ap.plan(mlp(), TP2, args=(X,), data_parallel="model")


def test_axis_used_twice_for_one_tensor():
    with raises(ap.ShardingError, "layers.0.fc1.weight", "dim 0", "two mesh axes", "'dp'", "'tp'"):
        ap.plan(mlp(), DPTP, args=(X,), annotations={"layers.0.fc1.weight": ap.place(ap.Shard(0), ap.Shard(0))})
    with raises(ap.ShardingError, "input 'x'", "two mesh axes"):
        ap.plan(mlp(), DPTP, args=(X,), annotations={"x": ap.place(ap.Shard(0), ap.Shard(0))})


def test_conflicting_annotations_name_both_patterns():
    with raises(ap.AnnotationError, "layers.0.fc1.weight", "'layers.*.fc1'", "'layers.0.*'", "disjoint"):
        ap.plan(mlp(), TP2, args=(X,), annotations={"layers.*.fc1": ap.colwise("tp"), "layers.0.*": ap.rowwise("tp")})


def test_pattern_matching_nothing_suggests_close_names():
    with raises(ap.AnnotationError, "'layer.*.fc1'", "matches no module path", "'layers.0.fc1'"):
        ap.plan(mlp(), TP2, args=(X,), annotations={"layer.*.fc1": ap.colwise("tp")})
    with raises(ap.AnnotationError, "'inp'", "matches no parameter or input name"):
        ap.plan(mlp(), TP2, args=(X,), annotations={"inp": ap.place(ap.Shard(0))})


def test_layer_annotation_on_module_without_such_parameters():
    with raises(ap.AnnotationError, "'layers.0'", "ModuleDict", "no 'weight'", "'layers.0.*'"):
        ap.plan(mlp(), TP2, args=(X,), annotations={"layers.0": ap.colwise("tp")})
    with raises(ap.AnnotationError, "'norm'", "LayerNorm", "(8,)", "Linear or Embedding"):
        ap.plan(mlp(), TP2, args=(X,), annotations={"norm": ap.rowwise("tp")})


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent control flow: the line the error must name
            return y * 2
        return y


def test_untraceable_model_names_the_users_file_and_line():
    import inspect

    line = (
        next(i for i, text in enumerate(inspect.getsource(Branchy).splitlines()) if "if y.sum() > 0" in text)
        + inspect.getsourcelines(Branchy)[1]
    )
    with raises(ap.TraceError, f"{__file__}:{line}", "data-dependent", "torch.where", "ap.opaque()"):
        ap.plan(Branchy(), TP2, args=(X,))


class Returns(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.fc, self.extra = nn.Linear(8, 8), extra

    def forward(self, x):
        return self.fc(x), self.extra


def test_model_output_that_is_not_tensors():
    with raises(ap.TraceError, "str", "'hello'", "tensors"):
        ap.plan(Returns("hello"), TP2, args=(X,))
    with raises(ap.TraceError, "Returns", "object", "tensors"):
        ap.plan(Returns(object()), TP2, args=(X,))


def test_batch_not_divisible_by_data_parallel_axis():
    """A plan traced with a batch that divides keeps the even forms and refuses one that does not,
    saying how to get a plan that takes it (traced with an uneven batch: issue 24)."""
    plan = ap.plan(mlp(), ap.Mesh((4,), ("dp",)), args=(torch.randn(8, 8),), data_parallel="dp")
    with raises(ap.InputError, "'x'", "(6, 8)", "'dp'", "multiple of 4", "example batch that is not"):
        plan.local_inputs(0, torch.randn(6, 8))
    ragged = ap.plan(mlp(), ap.Mesh((4,), ("dp",)), args=(torch.randn(6, 8),), data_parallel="dp")
    assert [a[0].shape[0] for a in (ragged.local_inputs(r, torch.randn(6, 8))[0] for r in range(4))] == [2, 2, 1, 1]


def test_rank_outside_the_mesh():
    plan = ap.plan(mlp(), TP2, args=(X,), annotations={"layers.0.fc1": ap.colwise("tp")})
    for bad in (2, -1):
        with raises(ap.MeshError, f"Rank {bad}", "Mesh(tp=2)", "0..1"):
            plan.module(bad)
    with raises(ap.MeshError, "Rank 5"):
        plan.local_inputs(5, X)


def test_rank_module_called_with_global_instead_of_local_inputs():
    plan = ap.plan(mlp(), TP2, args=(X,), annotations={"x": ap.place(ap.Shard(1))})
    gm = plan.module(1)
    with raises(ap.InputError, "rank 1", "'x'", "(4, 8)", "(S(1))", "global input was passed", "plan.local_inputs(1"):
        gm(X)
    with raises(ap.InputError, "rank 1", "has 3 dims"):
        gm(X.view(4, 2, 4))
    outs = plan.simulate(lambda module, x: module(x), X)  # the local pieces pass the guard
    assert [o.shape for o in outs] == [(4, 8), (4, 8)]


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.fc(x) + y


def test_dynamic_dims_shared_by_inputs_must_agree():
    plan = ap.plan(TwoInputs(), ap.Mesh((2,), ("dp",)), args=(X, X.clone()), data_parallel="dp")
    gm = plan.module(0)
    (a, b), _ = plan.local_inputs(0, X, X)
    with raises(ap.InputError, "'y'", "global size 8", "'x' means 4"):
        gm(a, X)
    outs = plan.simulate(lambda module, x, y: module(x, y), X, X)
    assert [o.shape for o in outs] == [(2, 8), (2, 8)]


def test_guard_checks_divisibility_of_dynamic_sizes_split_inside_the_graph():
    from autopar.codegen.input_guard import check_local_inputs

    checks = (("x", "(S(0))", ("s0", 8), ((None, 2, "s0"), (8, 1, None))),)
    check_local_inputs((torch.zeros(4, 8),), checks, 0, (("s0", 4, "reshape_3"),))  # 8 divides by 4
    with raises(ap.InputError, "'x'", "global size 6", "4 pieces", "'reshape_3'", "divisible by 4"):
        check_local_inputs((torch.zeros(3, 8),), checks, 0, (("s0", 4, "reshape_3"),))


# ------------------------------------------ messages matched as regular expressions
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


class Renorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.renorm(x * self.w, 2, 0, 1.0).cumprod(0)  # renorm: no rule (flip has one since issue 31)


def test_op_without_rule_strict_names_op_and_module():
    x = torch.randn(8, 4)
    with pytest.raises(ap.NoRuleError, match=r"aten.renorm.default at node 'renorm'.*S\(0\)"):
        ap.plan(Renorm(), ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp", strict=True)


def test_op_without_rule_falls_back_correctly_with_warning():
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match="no sharding rule for aten.renorm.default"):
        plan = ap.plan(Renorm(), ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp")
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
    with pytest.raises(ap.TraceError, match=rf"{re.escape(Path(__file__).name)}:\d+.*data-dependent"):
        ap.plan(DataDependent(), ap.Mesh((2,), ("dp",)), args=(torch.randn(4, 4),))


def test_place_needs_one_placement_per_axis():
    with pytest.raises(ap.AnnotationError, match="gives 1 placements but the mesh"):
        mlp_plan(ap.Mesh((2, 2), ("dp", "tp")), {"x": ap.place(Shard(0))})


def test_conflicting_annotations():
    with pytest.raises(ap.AnnotationError, match="Conflicting annotations for 'layers.0.fc1.weight'"):
        mlp_plan(ap.Mesh((2,), ("tp",)), {"layers.*.fc1": ap.colwise("tp"), "layers.0.fc1": ap.rowwise("tp")})
