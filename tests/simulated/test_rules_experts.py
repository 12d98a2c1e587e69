"""MoE experts: the grouped expert matmul's rule against serial (forward and every gradient) on
(2,), (4,) and (2, 2) with the experts split (expert parallelism), every expert column- or
row-parallel; presets.megatron splits the experts of Mixtral, Qwen3-MoE and OLMoE (a rank
holds about 1/tp of the expert parameters) and equals serial on (2,) and (2, 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar as ap
from tests.harness.hf_models import preset_plans
from bench.survey_models import architectures, build
from tests.harness.meshes import RULE_MESHES

import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

S, R = ap.Shard, ap.Replicate()
E, K, N, ROWS = 4, 8, 8, 12
# rows per expert 3, 0, 5, 4: one expert gets no token, and the experts' row ranges do not
# line up with an even split of the rows
ROUTING = torch.tensor([0, 2, 3, 2, 0, 3, 2, 3, 2, 0, 2, 3])


class Experts(nn.Module):
    """Tokens sorted by expert, an up and a down grouped matmul with an activation between
    (the shape of transformers' grouped_mm experts), weighted by a per-token gate."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.up = nn.Parameter(torch.randn(E, K, N) / 3)
        self.down = nn.Parameter(torch.randn(E, N, K) / 3)

    def forward(self, x, routing):
        ids, perm = torch.sort(routing, stable=True)
        offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
        h = self.op(x[perm], self.up, offs)
        h = self.op(torch.nn.functional.silu(h), self.down, offs)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.shape[0])
        return h[back] * x.sum(-1, keepdim=True).sigmoid()


def fallback(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


LAYOUTS = {  # parameter placements per mesh: (2,), (4,), (2, 2)
    "experts_split": {"up": [(S(0),), (S(0),), (R, S(0))], "down": [(S(0),), (S(0),), (R, S(0))]},
    # (2, 2): experts split on b, each expert column- then row-parallel on a
    "experts_and_columns": {"up": [(S(0),), (S(0),), (S(2), S(0))], "down": [(S(0),), (S(0),), (S(1), S(0))]},
    "column_then_row": {"up": [(S(2),), (S(2),), (S(0), S(2))], "down": [(S(1),), (S(1),), (S(0), S(1))]},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_mm_matches_serial(layout):
    torch.manual_seed(0)
    model = Experts(fallback)
    x = torch.randn(ROWS, K)
    for i, (shape, axes) in enumerate((m.shape, m.axes) for m in RULE_MESHES):
        ann = {name: ap.place(*per_mesh[i]) for name, per_mesh in LAYOUTS[layout].items()}
        plan = ap.plan(model, ap.Mesh(shape, axes), args=(x, ROUTING), annotations=ann, strict=True)
        plan.check(x, ROUTING, rtol=1e-4, atol=1e-5)
        assert not [n for n in plan.graph.nodes if getattr(n.meta.get("autopar"), "fallback", False)]
        if layout.startswith("experts"):  # each rank holds E / (ranks splitting the experts) experts
            assert dict(plan.module(0).named_parameters())["up"].shape[0] == E // shape[-1]


def test_native_grouped_mm_forward_matches_serial():
    """aten._grouped_mm (what transformers runs in bf16; bf16 only): forward only, since its CPU
    backward fails in torch itself ("Invalid strides/sizes"), serial or not."""
    torch.manual_seed(0)
    model = Experts(lambda x, w, offs: torch._grouped_mm(x, w, offs=offs)).to(torch.bfloat16)
    x = torch.randn(ROWS, K, dtype=torch.bfloat16)
    with torch.no_grad():
        serial = model(x, ROUTING)
    for i, (shape, axes) in enumerate((m.shape, m.axes) for m in RULE_MESHES):
        ann = {name: ap.place(*per_mesh[i]) for name, per_mesh in LAYOUTS["experts_split"].items()}
        plan = ap.plan(model, ap.Mesh(shape, axes), args=(x, ROUTING), annotations=ann, strict=True)
        with torch.no_grad():
            outs = plan.simulate(lambda m, *a: m(*a), x, ROUTING)
        got = outs[0][0] if isinstance(outs[0], (tuple, list)) else outs[0]
        torch.testing.assert_close(got, serial, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"])
def test_preset_splits_experts(name):
    model, kw = build(next(a for a in architectures() if a.name == name))
    preset = ap.presets.megatron(model, "tp", kwargs=kw)
    experts = [p for p, a in preset.items() if isinstance(a, ap.expert_parallel)]
    assert experts == ["model.layers.0.mlp.experts"], preset.explain()
    assert "experts run by grouped matmuls" in preset.explain()
    expert_params = {n: p.numel() for n, p in model.named_parameters() if ".experts." in n}
    for plan in preset_plans(model, kw, preset):
        assert not [n for n in plan.graph.nodes if getattr(n.meta.get("autopar"), "fallback", False)]
        plan.check(**kw, rtol=1e-3, atol=1e-4)
        local = {n: p.numel() for n, p in plan.module(0).named_parameters() if n in expert_params}
        assert sum(local.values()) == sum(expert_params.values()) // 2, (plan.mesh, local)
