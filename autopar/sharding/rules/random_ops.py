"""Random ops: where their draws may be split (the draws themselves follow the placements,
sharding/lowerings/random_draws.py).

Values do not matter to a fill (``x.exponential_()``, ``normal_``, ``uniform_``, ``bernoulli_``,
``random_``, ...), and ``bernoulli(p)``, ``normal(mean, std)``, randint_like and the feature and
alpha dropouts draw element by element (per batch and channel for feature dropout): any split
works, as for an elementwise op, never a partial sum. ``multinomial`` samples each row from the
whole row: rows may be split, the class dim not. ``poisson``'s draws depend on every rate (its
CPU sampler loops per value), so serial mode can only reproduce it whole: replicated.
``randperm`` and ``normal(float, float, size)`` make tensors from sizes: replicated.

Example:
    >>> get_rule(aten.exponential_.default)(op)   # [R] -> [R], [S(0)] -> [S(0)], ...
"""

from __future__ import annotations

import torch

from autopar.placement import Shard
from autopar.sharding.rules.creation import creation_rule
from autopar.sharding.rules.pointwise import shard_strategies
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, register

aten = torch.ops.aten


@register(
    *aten_ops(
        "exponential_",
        "normal_",
        "uniform_",
        "cauchy_",
        "log_normal_",
        "geometric_",
        "bernoulli_.float",
        "bernoulli_.Tensor",
        "random_",
        "random_.to",
        "random_.from",
        "bernoulli",
        "bernoulli.p",
        "randint_like",
        "randint_like.low_dtype",
        "normal.Tensor_float",
        "normal.float_Tensor",
        "normal.Tensor_Tensor",
        "feature_dropout",
        "alpha_dropout",
        "feature_alpha_dropout",
        "feature_dropout_",
        "alpha_dropout_",
        "feature_alpha_dropout_",
    )
)
def random_elementwise_rule(op: OpInfo) -> list[Strategy]:
    return shard_strategies(op)


@register(aten.multinomial.default)
def multinomial_rule(op: OpInfo) -> list[Strategy]:
    probs = op.tensors[0]
    strategies = [op.replicated()]
    for d in range(probs.ndim - 1):  # rows (a 2-D input's first dim); never the classes
        if probs.shape[d] != 1:
            strategies.append(op.strategy({probs: Shard(d)}, Shard(d)))
    return strategies


@register(aten.poisson.default)
def poisson_rule(op: OpInfo) -> list[Strategy]:
    return [op.replicated()]


register(*aten_ops("randperm", "normal.float_float"))(creation_rule)
