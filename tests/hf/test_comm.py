"""Communication of the Megatron plan on HF LLaMA equals the analytic minimum, and what
runs (ap.comm_stats) equals what the plan lists (Plan.collectives), for 1, 2 and 3 layers.

Per layer, over tp of size n, each collective on a (B, S, H) activation of E = B*S*H floats:
  Megatron:          2 all-reduces forward + 2 backward, each 2(n-1)/n * 4E bytes per rank
  sequence parallel: 2 all-gathers + 2 reduce-scatters forward, 2 + 2 backward, (n-1)/n * 4E
Outside the layers only the embedding, the LM head and the loss communicate.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch.nn as nn

import autopar as ap
from tests.harness.comm import runtime_matches_static
from tests.harness.hf_models import HIDDEN, MODELS, SEQ, hf_plan, inputs, llama

import transformers  # noqa: E402,F401  (pinned: a missing one is a failure, not a skip)

B = 4
E = B * SEQ * HIDDEN
# one layer under sequence parallel: a gather before and a reduce-scatter after attention and MLP
SP_PER_LAYER = {
    ("all_gather", "forward"): 2,
    ("reduce_scatter", "forward"): 2,
    ("all_gather", "backward"): 2,
    ("reduce_scatter", "backward"): 2,
}


def _layer_comms(plan, i):
    return [c for c in plan.collectives() if c.module.startswith(f"model.layers.{i}.")]


def _kinds(comms):
    return Counter((c.kind, c.phase) for c in comms)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_megatron_minimum(layers):
    plan, kw = hf_plan("llama", "tp2", layers=layers)
    n = 2
    for i in range(layers):
        comms = _layer_comms(plan, i)
        assert _kinds(comms) == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}
        assert all(c.bytes == 2 * (n - 1) / n * 4 * E and c.axis == "tp" for c in comms)
    outside = [c for c in plan.collectives() if not c.module.startswith("model.layers.")]
    assert _kinds(outside) == {
        ("all_reduce", "forward"): 3,  # embedding's partial sums; loss: sum exp, target logit
        ("all_reduce", "backward"): 1,  # the LM head's input gradient
        ("all_gather", "forward"): 2,
    }  # loss: row maxima; the returned logits
    runtime_matches_static(plan, kw)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_sequence_parallel_minimum(layers):
    model, kw = llama(layers=layers), inputs("llama")
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, annotations=ann, dynamic=False)
    for i in range(layers):
        comms = _layer_comms(plan, i)
        assert _kinds(comms) == SP_PER_LAYER
        assert all(c.bytes == 1 / 2 * 4 * E for c in comms)
    assert not [c for c in plan.collectives() if c.kind == "all_reduce" and c.bytes >= E]
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    runtime_matches_static(plan, kw)


class LossOnly(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def test_loss_never_gathers_logits():
    model, kw = LossOnly(llama()), inputs("llama")
    ann = {f"model.{k}": v for k, v in ap.presets.megatron(model.model, "tp", kwargs=kw).items()}
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, annotations=ann, dynamic=False)
    biggest = max(c.bytes for c in plan.collectives())
    assert biggest <= 2 * 4 * E  # nothing of vocabulary size: the logits stay split by class
    plan.check(**kw, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh_name,tp", [("tp2", 2), ("tp4", 4), ("dp2xtp2", 2)])
def test_parameter_bytes_per_rank(mesh_name, tp):
    plan, _ = hf_plan("llama", mesh_name)
    sharded = {n for n, s in plan.param_specs.items() if any(isinstance(p, ap.Shard) for p in s)}
    assert {n.rsplit(".", 2)[-2] for n in sharded} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "embed_tokens",
        "lm_head",
    }
    expected = sum(p.numel() * 4 // (tp if n in sharded else 1) for n, p in plan.model.named_parameters())
    for rank in plan.mesh.ranks():
        got = sum(p.numel() * p.element_size() for p in plan.module(rank).parameters())
        assert got == expected


LAYER_PREFIX = {"llama": "model.layers.{}.", "gpt2": "transformer.h.{}.", "bert": "encoder.layer.{}."}


@pytest.mark.parametrize("sp", [False, True], ids=["megatron", "sequence_parallel"])
@pytest.mark.parametrize("name", list(LAYER_PREFIX))
def test_every_model_meets_the_per_layer_minimum(name, sp):
    model, kw = MODELS[name][0](layers=2), inputs(name)
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=sp)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, annotations=ann, dynamic=False)
    for i in range(2):
        comms = [c for c in plan.collectives() if c.module.startswith(LAYER_PREFIX[name].format(i))]
        if sp:
            assert _kinds(comms) == SP_PER_LAYER
            assert all(c.bytes == 1 / 2 * 4 * E for c in comms)
        else:
            assert _kinds(comms) == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}
            assert all(c.bytes == 2 * 1 / 2 * 4 * E for c in comms)
