"""Issue 40's user paths on a LLaMA written as torchtitan writes it (tests/harness/titan_llama.py),
simulated: grouped-query attention with fewer kv heads than tp ranks, and blocks kept in an
``nn.ModuleDict``."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from tests.harness.titan_llama import TP, titan_batch, titan_llama


@pytest.mark.parametrize(
    "kv_heads,tp,how",
    [(2, 4, "annotations"), (1, 2, "annotations"), (2, 4, "preset"), (4, 4, "annotations"), (2, 2, "preset")],
)
def test_gqa_with_fewer_kv_heads_than_ranks_equals_serial(kv_heads, tp, how):
    """``sdpa(..., enable_gqa=True).transpose(1, 2).contiguous().view(bs, s, -1)``: export drops the
    ``.contiguous()``, and with kv heads < tp the rank's attention output had other strides than
    the serial one, so every rank failed with "view size is not compatible" (the plan was accepted)."""
    model, args = titan_llama(n_kv_heads=kv_heads), titan_batch()
    ann = TP if how == "annotations" else ap.presets.megatron(model, "tp", args=args, size=tp)
    plan = ap.plan(model, ap.Mesh((tp,), ("tp",)), args=args, annotations=ann)
    result = plan.check(*args)  # forward and every gradient against serial
    assert result["grads"] == len(list(model.parameters()))


class _ViewWritten(torch.nn.Module):
    """A view whose memory is written in place: it must stay a view (a copy would lose the write)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        h.view(-1, 2, 4).mul_(2.0)  # writes h through the view
        return h.transpose(0, 1).contiguous().view(-1)  # a view of nothing written: reshape on a rank


def test_views_run_as_reshape_unless_their_memory_is_written():
    torch.manual_seed(0)
    model, x = _ViewWritten(), torch.randn(4, 8)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations={"lin": ap.colwise("tp")})
    code = plan.module(0).code
    assert code.count("torch.Tensor.view(") == 1 and code.count("torch.reshape(") == 1, code
    plan.check(x)


def test_moduledict_layers_are_repeated_blocks():
    """torchtitan keeps its blocks in ``nn.ModuleDict`` ``layers`` ("0", "1", ...): the trace copies
    them as it copies a ModuleList's (the graph a full export gives), and checkpointing finds each."""
    from tests.simulated.test_repeated_blocks import assert_same_as_full_export

    model, args = titan_llama(n_layers=4), titan_batch()
    fast = assert_same_as_full_export(model, args)
    assert (fast.repeated.prefix, fast.repeated.count) == ("layers", 4)
    plan = ap.plan(
        model, ap.Mesh((2,), ("tp",)), args=args, annotations=TP, activation_checkpoint=ap.ActivationCheckpoint()
    )
    assert plan.built["activation_checkpoint"] == [f"layers.{i}" for i in range(4)]
    assert "checkpoint_layers_3(" in plan.module(0).code
    plan.check(*args)


def test_moduledict_of_other_keys_or_unlike_children_is_no_stack():
    """Keys that are not the positions, or children that differ, are no stack (exported whole)."""
    from autopar.trace.repeat_blocks import find_repeated

    model = titan_llama(n_layers=4)
    assert find_repeated(model).prefix == "layers"
    model.layers = torch.nn.ModuleDict({f"l{k}": b for k, b in model.layers.items()})
    assert find_repeated(model) is None
    model.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4 + i) for i in range(4)})
    assert find_repeated(model) is None
