"""Issue 12's crashes and contracts: rules per overload (elementwise min/max), T5 with the
Megatron preset and with ap.opaque attention, .item() errors, placements' text round trip
through plan files, what the input guard checks, plan.check's error scale and tolerances."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.placement import Partial, Replicate, Shard, parse_placement
from autopar.sharding.propagate import layout_of
from autopar.sharding.rules import get_rule, register, registered_ops

MESHES = [((2,), ("dp",)), ((4,), ("tp",)), ((2, 2), ("dp", "tp"))]
aten = torch.ops.aten


# ------------------------------------------------------------------- rules per overload
class MinMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        return torch.max(a, b).sum() + torch.min(a, b).square().sum() + a.max(dim=1).values.sum()


@pytest.mark.parametrize("shape,axes", MESHES)
def test_elementwise_min_max_plan_and_match_serial(shape, axes):
    torch.manual_seed(0)
    model, x = MinMax(), torch.randn(8, 4)
    ann = {"a": ap.colwise("tp"), "b": ap.colwise("tp")} if "tp" in axes else {}
    plan = ap.plan(
        model, ap.Mesh(shape, axes), args=(x,), annotations=ann, data_parallel="dp" if "dp" in axes else None
    )
    plan.check(x)
    if "tp" in axes:  # the elementwise max keeps the column split (pointwise rule, not a reduction)
        node = next(n for n in plan.graph.nodes if n.target is aten.max.other)
        assert Shard(1) in layout_of(node).spec


def test_every_registration_is_one_overload_and_unique():
    assert all(isinstance(op, torch._ops.OpOverload) for op in registered_ops())
    assert get_rule(aten.max.other) is get_rule(aten.maximum.default)
    assert get_rule(aten.max.dim) is not get_rule(aten.max.other)
    assert get_rule(aten.where.default) is None  # where(cond) is nonzero, not elementwise
    assert get_rule(aten.view.dtype) is None  # a bit cast, not a reshape
    with pytest.raises(TypeError, match="overload packet"):
        register(aten.relu)
    with pytest.raises(ValueError, match="already has the rule"):
        register(aten.relu.default)(lambda op: [])
    assert get_rule(aten.relu.default).__name__ == "elementwise_rule"
    assert get_rule(aten.cross_entropy_loss.default).__name__ == "vocab_cross_entropy_rule"


def test_norm_reduction_reads_dim_not_p():
    """linalg_vector_norm(x, ord, dim): the rule must read dim (arg 2), not ord (arg 1)."""

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x):
            return torch.linalg.vector_norm(self.fc(x), 2, dim=0)

    torch.manual_seed(0)
    model, x = Norm(), torch.randn(6, 4)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations={"fc": ap.colwise("tp")})
    plan.check(x)
    node = next(n for n in plan.graph.nodes if n.target is aten.linalg_vector_norm.default)
    assert layout_of(node).spec == (Shard(0),)  # the feature split survives a norm over rows


# -------------------------------------------------------------------------------- T5
def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        attn_implementation="eager",
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(1, 128, (4, 8), generator=g), torch.randint(1, 128, (4, 8), generator=g)
    return T5ForConditionalGeneration(cfg).eval(), dict(input_ids=ids, labels=labels)


def test_t5_megatron_preset_plans_and_matches_serial():
    model, kw = t5()
    ann = ap.presets.megatron(model, "tp", args=(), kwargs=kw)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, annotations=dict(ann))
    plan.check(loss=lambda o: o.loss, **kw)
    assert any(n.target is aten.minimum.default or n.target is aten.min.other for n in plan.graph.nodes)


def test_t5_opaque_self_attention():
    model, kw = t5()
    plan = ap.plan(
        model,
        ap.Mesh((2,), ("tp",)),
        kwargs=kw,
        annotations={
            "encoder.block.*.layer.0.SelfAttention": ap.opaque(),
            "encoder.block.*.layer.1.DenseReluDense.wi": ap.colwise("tp"),
            "encoder.block.*.layer.1.DenseReluDense.wo": ap.rowwise("tp"),
        },
    )
    assert any(n.target is torch.ops.autopar.opaque_call.default for n in plan.graph.nodes)
    plan.check(loss=lambda o: o.loss, **kw)


# ------------------------------------------------------------------ .item() in arithmetic
def test_item_in_arithmetic_is_a_plan_error_naming_the_way_out():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x):
            h = self.fc(x)
            return (h * h.detach().abs().max().item()).sum()

    with pytest.raises(ap.ShardingError) as e:
        ap.plan(Scaled(), ap.Mesh((2,), ("dp",)), args=(torch.randn(8, 4),), data_parallel="dp")
    msg = str(e.value)
    assert "'mul'" in msg and "item" in msg and "ap.opaque()" in msg and ".item()" in msg


# ---------------------------------------------------------------- placements as text
KINDS = [Replicate(), Shard(0), Shard(-1), Shard(1, blocks=3), Partial("sum"), Partial("avg")]


@pytest.mark.parametrize("p", KINDS, ids=repr)
def test_placement_text_round_trip(p):
    assert parse_placement(repr(p)) == p


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).split(8, -1)
        y = q * k + v
        return self.proj(y), y.mean(-1)  # (not added: R + P(avg) has wrong gradients, see report)


def test_every_placement_kind_through_plan_file(tmp_path):
    torch.manual_seed(0)
    model, x = Fused(), torch.randn(8, 8)
    plan = ap.plan(
        model,
        ap.Mesh((2, 2), ("dp", "tp")),
        args=(x,),
        data_parallel="dp",
        annotations={"qkv": ap.colwise("tp", blocks=3), "proj": ap.rowwise("tp")},
    )
    path = tmp_path / "fused.json"
    plan.save(path)
    text = path.read_text()
    for kind in ("S(0,blocks=3)", '"P"', "P(avg)", '"R"', '"S(0)"', '"S(1)"'):
        assert kind in text, kind
    loaded = ap.load_plan(path, model)

    def layouts(p):
        return {
            n.name: (layout_of(n).outputs, layout_of(n).input_targets) for n in p.graph.nodes if "autopar" in n.meta
        }

    assert layouts(loaded) == layouts(plan) and loaded.param_specs == plan.param_specs
    loaded.check(x)
    json.loads(text)


# -------------------------------------------------------------------------- input guard
class Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x, t):
        return F.cross_entropy(self.fc(x), t)


def _run_with(plan, x, t, args):
    return plan.simulate(lambda module, *_: module(*args), x, t)


def test_input_guard_what_is_checked():
    torch.manual_seed(0)
    x, t = torch.randn(8, 6), torch.randint(0, 5, (8,))
    static = ap.plan(Loss(), ap.Mesh((2,), ("dp",)), args=(x, t), data_parallel="dp", dynamic=False)
    with pytest.raises(ap.SimulationError, match="global input was passed"):
        _run_with(static, x, t, (x, t))
    dynamic = ap.plan(Loss(), ap.Mesh((2,), ("dp",)), args=(x, t), data_parallel="dp")
    with pytest.raises(ap.SimulationError, match="InputError.*means 16 for the same dim"):
        _run_with(dynamic, x, t, (x, t[:4]))
    # documented limit: a dynamic batch passed globally as every input is a valid local batch
    _run_with(dynamic, x, t, (x, t))
    errors_page = open("docs/errors.md").read()  # the README's API table moved there (issue 49)
    assert "cannot be told from a larger local one and is not caught" in errors_page


# --------------------------------------------------------------------------- plan.check
class ShiftInvariant(nn.Module):
    """c shifts every logit alike: its gradient is zero in exact arithmetic, noise in floats."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)
        self.c = nn.Parameter(torch.tensor(0.3))

    def forward(self, x, t):
        return F.cross_entropy(self.b(torch.relu(self.a(x))) + self.c, t)


@pytest.mark.parametrize("shape,axes", MESHES)
def test_check_error_is_scaled_below_one_for_zero_gradients(shape, axes):
    torch.manual_seed(0)
    x, t = torch.randn(32, 16), torch.randint(0, 16, (32,))
    ann = {"a": ap.colwise("tp"), "b": ap.rowwise("tp")} if "tp" in axes else {}
    plan = ap.plan(
        ShiftInvariant(),
        ap.Mesh(shape, axes),
        args=(x, t),
        annotations=ann,
        data_parallel="dp" if "dp" in axes else None,
    )
    report = plan.check(x, t)
    assert report["max_rel"] < 0.1 and report["rtol"] == 1e-5


def test_check_tolerances_follow_dtype():
    torch.manual_seed(0)
    x, t = torch.randn(32, 16), torch.randint(0, 16, (32,))
    model = ShiftInvariant().to(torch.bfloat16)
    plan = ap.plan(
        model,
        ap.Mesh((2, 2), ("dp", "tp")),
        args=(x.bfloat16(), t),
        data_parallel="dp",
        annotations={"a": ap.colwise("tp"), "b": ap.rowwise("tp")},
    )
    report = plan.check(x.bfloat16(), t)
    from autopar.runtime.serial_check import TOLERANCES

    assert (report["rtol"], report["atol"]) == TOLERANCES[torch.bfloat16]
    with pytest.raises(ap.PlanMismatch):
        plan.check(x.bfloat16(), t, rtol=1e-5, atol=1e-6)  # fp32 tolerances are too tight for bf16


@pytest.mark.parametrize("vocab", [False, True])
def test_check_tolerance_scales_with_the_tensor(vocab):
    """A correct tp plan of a GPT whose logits reach +-17: a logit near 0 one rounding unit of the
    large ones off (3.8e-6) is no mismatch (an absolute atol=1e-6 reported one), while a difference
    of 1e-4 of the tensor's scale in that element still is."""
    from autopar.runtime.serial_check import _compare
    from tests.harness.models import GPT_VOCAB, MEGATRON, gpt_batch, small_gpt

    model = small_gpt(tied=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    idx = gpt_batch(batch=4, seq=16)[0]
    plan = ap.plan(model, ap.Mesh((4,), ("tp",)), args=(idx,), annotations={**MEGATRON, **(GPT_VOCAB if vocab else {})})
    assert plan.check(idx)["max_rel"] < 1e-5
    logits = model(idx).detach()
    wrong = logits.clone()
    wrong[0, 0, 0] += 1e-4 * logits.abs().max()
    with pytest.raises(ap.PlanMismatch, match=r"first at index \(0, 0, 0\)"):
        _compare("logits", logits, wrong, 1e-5, 1e-6)
