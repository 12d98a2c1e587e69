"""Vocabulary parallel: an embedding's rows and an LM head's classes split on tp, and the
cross-entropy on split logits (vocab-parallel loss: row maxima, sum of exponentials and target
logit reduced; a full row never gathered). Against serial, forward and every gradient, on
(2,), (4,) and (2, 2) = dp x tp. HuggingFace models: hf/test_models.py, hf/test_comm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from tests.harness.comm import runtime_matches_static
from tests.harness.meshes import MESHES, TP
from tests.harness.models import GPT_VOCAB, MEGATRON, gpt_batch, gpt_plan

S = ap.Shard


class Head(nn.Module):
    def __init__(self, d=16, vocab=32, reduction="mean"):
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)
        self.reduction = reduction

    def forward(self, x, target):
        return F.cross_entropy(self.head(x), target, reduction=self.reduction)


@pytest.mark.parametrize("mesh_name", TP)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(reduction, mesh_name):
    torch.manual_seed(0)
    x, target = torch.randn(8, 16), torch.randint(0, 32, (8,))
    target[1] = target[6] = -100
    spec = MESHES[mesh_name]
    plan = ap.plan(
        Head(reduction=reduction),
        spec.mesh(),
        args=(x, target),
        annotations={"head": ap.vocab_parallel("tp")},
        data_parallel=spec.dp,
    )
    plan.check(x, target)
    loss_node = next(n for n in plan.graph.nodes if "cross_entropy" in str(n.target))
    assert loss_node.meta["autopar"].input_targets[0][-1] == S(1)  # logits never gathered on tp
    assert not [c for c in plan.collectives() if c.kind == "all_gather" and c.bytes > 8 * 4 * 4]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mesh_name", TP)
def test_gpt_vocab_parallel_matches_serial(mesh_name, tied):
    """The GPT with Megatron layers, its embedding and LM head split by vocabulary (tied: one
    tensor, one gradient): equal to serial, and what runs is what the plan lists."""
    plan = gpt_plan(mesh_name, tied=tied, annotations={**MEGATRON, **GPT_VOCAB})
    tp = plan.mesh.axis_names.index("tp")
    for name in ("wte.weight", "lm_head.weight"):
        assert plan.param_specs[name][tp] == S(0) and all(
            p.is_replicate() for i, p in enumerate(plan.param_specs[name]) if i != tp
        )
    if tied:
        gm = plan.build_module(0)
        assert gm.lm_head.weight is gm.wte.weight
    plan.check(*gpt_batch())
    plan.check(*gpt_batch(batch=4, seq=12, seed=5))  # other batch and sequence length
    runtime_matches_static(plan, args=gpt_batch(), loss=lambda out: out[1])


def test_gpt_vocab_parallel_loss_keeps_logits_split():
    """The loss reduces per-token scalars only: no collective at the cross-entropy carries a
    vocabulary-sized row; the logits are gathered only where the model returns them."""
    plan = gpt_plan("tp2", annotations={**MEGATRON, **GPT_VOCAB})
    loss_node = next(n for n in plan.graph.nodes if "cross_entropy" in str(n.target))
    assert loss_node.meta["autopar"].input_targets[0][-1].is_shard()
    at_loss = [c for c in plan.collectives() if c.node == loss_node.name]
    tokens = 8 * 8  # gpt_batch(): batch 8, sequence 8
    assert at_loss and all(c.bytes <= tokens * 4 for c in at_loss), at_loss
    # the head itself only reduces its input's gradient; logits are gathered for the output alone
    assert [(c.kind, c.phase) for c in plan.collectives() if c.module == "lm_head"] == [("all_reduce", "backward")]
    gathers = [c for c in plan.collectives() if c.kind == "all_gather" and c.bytes > tokens * 4]
    assert [c.node for c in gathers] == ["output"]
