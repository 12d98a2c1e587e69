"""Every row of codegen/fast_calls.BINDINGS computes what its aten op computes, for the argument
forms a traced graph holds (defaults left out, keywords as fx writes them)."""

from __future__ import annotations

import pytest
import torch

from autopar.codegen import fast_calls
from autopar.codegen.fast_calls import BINDINGS

aten = torch.ops.aten
_X = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
_POS = _X.abs() + 0.1
_IDS = torch.tensor([[0, 2], [1, 3]])

# op -> calls (args, kwargs) as a traced graph writes them
CASES = {
    aten.add.Tensor: [((_X, _X), {}), ((_X, 2.0), {})],
    aten.mul.Tensor: [((_X, _X), {}), ((_X, 0.5), {})],
    aten.linear.default: [((_X, torch.randn(5, 4)), {}), ((_X, torch.randn(5, 4), torch.randn(5)), {})],
    aten.matmul.default: [((_X, torch.randn(4, 2)), {})],
    aten.layer_norm.default: [((_X, [4], torch.ones(4), torch.zeros(4), 1e-05, False), {})],
    aten.gelu.default: [((_X,), {}), ((_X,), {"approximate": "tanh"})],
    aten.dropout.default: [((_X, 0.0, True), {}), ((_X, 0.5, False), {})],
    aten.transpose.int: [((_X, -2, -1), {})],
    aten.permute.default: [((_X, [2, 0, 1]), {})],
    aten.reshape.default: [((_X, [6, -1]), {})],
    aten.view.default: [((_X, [2, 12]), {})],
    aten.unbind.int: [((_X,), {}), ((_X, 1), {})],
    aten.softmax.int: [((_X, -1), {})],
    aten.masked_fill.Scalar: [((_X, _X > 0, float("-inf")), {})],
    aten.embedding.default: [((torch.randn(4, 3), _IDS), {})],
    aten.tril.default: [((_X,), {})],
    aten.bitwise_not.default: [((_X > 0,), {})],
    aten.sym_size.int: [((_X, 1), {})],
    aten.arange.default: [((5,), {"device": torch.device("cpu"), "pin_memory": False})],
    aten.ones.default: [(([2, 2],), {"dtype": torch.bool, "device": torch.device("cpu"), "pin_memory": False})],
    aten.zeros.default: [(([2, 3],), {"dtype": torch.float32})],
    aten.full.default: [(([2, 3], 1.5), {"dtype": torch.float32})],
    aten.cross_entropy_loss.default: [
        ((torch.randn(4, 5), torch.tensor([0, 1, 4, 2])), {}),
        ((torch.randn(4, 5), torch.tensor([0, -100, 4, 2]), None, 2, -100), {}),
    ],
    aten.tanh.default: [((_X,), {})],
    aten.relu.default: [((_X,), {})],
    aten.sigmoid.default: [((_X,), {})],
    aten.silu.default: [((_X,), {})],
    aten.exp.default: [((_X,), {})],
    aten.neg.default: [((_X,), {})],
    aten.rsqrt.default: [((_POS,), {})],
    aten.sub.Tensor: [((_X, _POS), {}), ((_X, _POS), {"alpha": 2})],
    aten.div.Tensor: [((_X, _POS), {}), ((_X, 3.0), {})],
    aten.pow.Tensor_Scalar: [((_X, 2), {})],
    aten.ne.Scalar: [((_IDS, -100), {})],
    aten.mean.dim: [((_X, [-1]), {}), ((_X, [-1], True), {}), ((_X, None), {})],
    aten.sum.dim_IntList: [((_X > 0, []), {"dtype": torch.float32}), ((_X, [0, 2]), {})],
    aten.t.default: [((_X[0],), {})],
    aten.unsqueeze.default: [((_X, 1), {})],
    aten.squeeze.dim: [((_X[:1], 0), {})],
    aten.select.int: [((_X, 1, 2), {})],
    aten.flatten.using_ints: [((_X,), {}), ((_X, 1, 2), {})],
    aten.cat.default: [(([_X, _X],), {}), (([_X, _X], 2), {})],
    aten.clone.default: [((_X,), {})],
}


def _binding(text: str):
    if text.startswith(fast_calls.AUTOPAR_FAST + "."):
        return getattr(fast_calls._WRAPPERS, text.split(".", 1)[1])
    obj = torch
    for part in text.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_every_row_has_a_case():
    assert set(BINDINGS) == set(CASES)


@pytest.mark.parametrize("op", list(BINDINGS), ids=str)
def test_binding_equals_op(op):
    fn = _binding(BINDINGS[op])
    for args, kwargs in CASES[op]:
        want, got = op(*args, **kwargs), fn(*args, **kwargs)
        if isinstance(want, (tuple, list)):
            assert len(want) == len(got) and all(torch.equal(w, g) for w, g in zip(want, got))
        elif isinstance(want, torch.Tensor):
            assert want.dtype == got.dtype and want.shape == got.shape
            if op is not aten.dropout.default or args[1] == 0.0 or not args[2]:
                assert torch.equal(want, got), (op, args, kwargs)
        else:
            assert want == got
