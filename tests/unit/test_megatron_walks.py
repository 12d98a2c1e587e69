"""The Megatron preset's walks back from each linear (megatron_plan._Graph._reads), kept per node
where they stop (_walked), against the plain walk node by node: the same pairs and the same
reasons for every layer left out, on models whose norms read the residual stream before their
weight (LLaMA: every walk went back to the embedding), with Conv1D layers whose own views a walk
passes (GPT-2), with qk-norms over one head's dim (OLMo-2:
a stop that a walk for its own layer passes), and with the nesting capped."""

import pytest
import torch

import autopar.presets.megatron_plan as mp
from autopar.trace.export import trace
from tests.harness.hf_models import batch, causal_lm, gpt2, llama
from tests.harness.models import gpt_batch, small_gpt


class Plain(mp._Graph):
    def _reads(self, start, own):  # the walk before the memo, node by node
        found, seen, todo = set(), set(), [start]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            layer = self._layer_at.get(node)
            if layer is not None and layer != own:
                if mp._layer_kind(self.modules[layer]) == "embedding":
                    if self._side_embedding(node):
                        continue
                    self.stop = f"reads the embedding {layer}"
                    return None
                found.add(layer)
                continue
            if node.op == "placeholder":
                val = node.meta.get("val")
                floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
                if node.name in self.params and self._per_head(val, own):
                    continue
                if node.name in self.params or (floating and node.name in self.traced.user_inputs):
                    self.stop = f"reads {self.traced.param_fqn.get(node.name, node.name)} (the residual stream)"
                    return None
                continue
            if node.op != "call_function" or node.target in mp.SIZE_ONLY:
                continue
            todo += [a for a in node.all_input_nodes]
        return found or None


def _models():
    ids, labels = batch()
    yield llama(layers=5), {"input_ids": ids, "labels": labels}
    yield causal_lm("olmo2", layers=3), {"input_ids": ids, "labels": labels}
    yield gpt2(layers=3), {"input_ids": ids, "labels": labels}  # Conv1D: a layer's own views walked
    x, y = gpt_batch()
    yield small_gpt(layers=4), {"idx": x, "targets": y}


@pytest.mark.parametrize("depth", [mp.WALK_DEPTH, 1])
def test_kept_walks_as_the_plain_walk(depth, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(mp, "WALK_DEPTH", depth)
    for model, kwargs in _models():
        traced = trace(model, kwargs=kwargs, dynamic=False)
        fast, plain = mp._Graph(model, traced), Plain(model, traced)
        assert fast.pairs() == plain.pairs()
        assert fast.why_not == plain.why_not
        assert fast._walks  # the walks were kept
