"""The Megatron preset's walks back from each linear (megatron_plan._Graph._reads), kept per node
where they stop (_walked), against the plain walk node by node: the same pairs and the same
reasons for every layer left out, on models whose norms read the residual stream before their
weight (LLaMA: every walk went back to the embedding), with Conv1D layers whose own views a walk
passes (GPT-2), with qk-norms over one head's dim (OLMo-2:
a stop that a walk for its own layer passes), and with the nesting capped."""

import pytest

import autopar.presets.megatron_plan as mp
from autopar.trace.export import trace
from tests.harness.hf_models import batch, causal_lm, gpt2, llama
from tests.harness.models import gpt_batch, small_gpt


class Plain(mp._Graph):
    """The walk with no walk kept: every node walked one by one (the walk before the memo)."""

    def _walked(self, node, own):
        return None


def _models():
    ids, labels = batch()
    yield llama(layers=5), {"input_ids": ids, "labels": labels}
    yield causal_lm("olmo2", layers=3), {"input_ids": ids, "labels": labels}
    yield gpt2(layers=3), {"input_ids": ids, "labels": labels}  # Conv1D: a layer's own views walked
    x, y = gpt_batch()
    yield small_gpt(layers=4), {"idx": x, "targets": y}


@pytest.mark.parametrize("depth", [mp.WALK_DEPTH, 1])
def test_kept_walks_as_the_plain_walk(depth, monkeypatch):
    monkeypatch.setattr(mp, "WALK_DEPTH", depth)
    for model, kwargs in _models():
        traced = trace(model, kwargs=kwargs, dynamic=False)
        fast, plain = mp._Graph(model, traced), Plain(model, traced)
        assert fast.pairs() == plain.pairs()
        assert fast.why_not == plain.why_not
        assert fast._walks  # the walks were kept
