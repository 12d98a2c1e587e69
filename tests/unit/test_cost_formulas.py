"""plan.cost() formulas and plan.collectives() bytes against the bytes the simulator moves
(tests.harness.comm charges each recorded collective the ring algorithm's bytes per rank, as
the cost model does; the same on real processes: gloo/test_comm_bytes.py)."""

from __future__ import annotations

import pytest
import sympy
import torch

import autopar as ap
from tests.harness.comm import planned_bytes, runtime_bytes
from tests.harness.models import MLP, gpt_batch, shared_gpt_plan

NAMES = {(2,): "tp2", (4,): "tp4", (2, 2): "dp2xtp2"}


def gpt_loss(out):
    return out[1]


def mlp_loss(out):
    return (out * torch.linspace(-1, 1, out.shape[-1])).sum()


@pytest.fixture(scope="module")
def gpt_plans():
    return {shape: shared_gpt_plan(name) for shape, name in NAMES.items()}


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)])
def test_gpt_formulas_equal_runtime_bytes(gpt_plans, shape):
    plan = gpt_plans[shape]
    idx, tgt = gpt_batch(batch=8, seq=8)
    want = planned_bytes(plan)
    assert runtime_bytes(plan, (idx, tgt), gpt_loss) == pytest.approx(want)
    assert want[("tp", "all_reduce")] > 0
    # the same formulas at another batch and sequence length (the modules are dynamic)
    idx2, tgt2 = gpt_batch(batch=4, seq=16, seed=3)
    assert runtime_bytes(plan, (idx2, tgt2), gpt_loss) == pytest.approx(planned_bytes(plan, B=4, S=16))


def test_gpt_tp_formula_per_layer(gpt_plans):
    plan = gpt_plans[(2, 2)]
    cost = plan.cost(sizes={"H": 32})
    B, S, H, dp, tp = (cost.symbols[k] for k in ("B", "S", "H", "dp", "tp"))
    # Megatron per layer: 2 forward all-reduces + 2 backward "f" all-reduces of a (B/dp, S, H) float32
    expected = 4 * (2 * (tp - 1) / tp) * 4 * B * S * H / dp
    assert sympy.simplify(cost.comm_by_layer[("blocks.0", "tp")] - expected) == 0
    assert sympy.simplify(cost.comm["tp"] - 2 * expected) == 0
    assert cost.example == {"B": 8, "S": 8, "H": 32, "dp": 2, "tp": 2}
    assert cost.at()["comm"]["tp"] == 2 * 4 * 1 * 4 * 8 * 8 * 32 / 2
    assert cost._repr_latex_().startswith("$$")
    # 2 layers x 4 all-reduces x 2(tp-1)/tp x a float32 (B/dp, S, H)
    assert float(cost.comm["tp"].subs({B: 4, S: 16, H: 32, dp: 2, tp: 4})) == 2 * 4 * (6 / 4) * 4 * (4 * 16 * 32) / 2
    assert set(plan.cost(names={"S": "T"}).example) == {"B", "T", "dp", "tp"}
    assert set(plan.cost(names={"idx.1": "T"}).example) >= {"B", "T", "dp", "tp"}


def test_memory_and_flops_formulas(gpt_plans):
    plan = gpt_plans[(2, 2)]
    cost = plan.cost()
    model = plan.model
    mem = cost.at()["memory"]
    local = sum(plan.shard_state_dict({n: p}, 0)[n].numel() * 4 for n, p in model.named_parameters())
    assert mem["params"] == local == mem["grads"]
    assert mem["optimizer"] == 2 * local
    tp_only = gpt_plans[(2,)].cost().at()["memory"]
    # dp halves the batch: the saved activations halve but for what does not hold the batch (the
    # causal mask the attention keeps, the loss's weights)
    assert tp_only["activations"] / 2 < mem["activations"] < 0.56 * tp_only["activations"]
    assert cost.at(B=16)["flops"] > cost.at()["flops"]
    t = cost.time(alpha=1e-5, beta=1e9, flops_per_s=1e12)
    n_tp = sum(1 for c in cost.comms if c.axis == "tp")
    expect_tp = n_tp * 1e-5 * 2 * (2 - 1) + cost.at()["comm"]["tp"] / 1e9
    assert cost.sy.value(t["comm"]["tp"]) == pytest.approx(expect_tp)
    sym = cost.time(alpha="alpha", beta="beta", flops_per_s="F")["total"]
    assert {"alpha", "beta", "F"} <= {s.name for s in sym.free_symbols}


@pytest.mark.parametrize(
    "ann,kinds",
    [
        ({"layers.*.fc1": ap.colwise("tp", output=ap.Replicate()), "layers.*.fc2": ap.replicated()}, {"all_gather"}),
        (
            {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp", output=ap.Shard(0))},
            {"reduce_scatter", "all_gather"},
        ),
    ],
)
def test_mlp_other_collectives_match_runtime(ann, kinds):
    torch.manual_seed(0)
    model = MLP(d=16, hidden=32, layers=2)
    x = torch.randn(8, 4, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations=ann)
    want = planned_bytes(plan)
    assert kinds <= {k for _, k in want}
    assert runtime_bytes(plan, (x,), mlp_loss) == pytest.approx(want)
