"""What rules offer, without running anything: the linear rule's Megatron strategies, and how a
view maps input dims to output dims (the numerics of every rule: simulated/test_rules.py)."""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules import OpInfo, TensorMeta, get_rule
from autopar.sharding.rules.views import view_dim_map

R, S = Replicate(), Shard


def meta(*shape):
    return TensorMeta(tuple(shape), torch.float32, (False,) * len(shape))


def test_linear_rule_offers_megatron_strategies():
    x, w = meta(4, 8, 16), meta(32, 16)
    op = OpInfo(torch.ops.aten.linear.default, (x, w), {}, [x, w], [meta(4, 8, 32)], {id(x): 0, id(w): 1})
    strategies = {(s.inputs, s.outputs) for s in get_rule(op.op)(op)}
    assert ((R, S(0)), (S(2),)) in strategies  # column parallel
    assert ((S(2), S(1)), (Partial(),)) in strategies  # row parallel: partial sum
    assert ((S(0), R), (S(0),)) in strategies  # batch split


def test_view_dim_map_splits_heads():
    assert view_dim_map((2, 8, 32), (2, 8, 4, 8)) == {0: 0, 1: 1, 2: 2}
    assert view_dim_map((2, 8, 4, 8), (2, 8, 32)) == {0: 0, 1: 1, 2: 2}
    assert view_dim_map((6, 4), (24,)) == {0: 0}
