"""Pooling: max/avg/adaptive pooling over the trailing 1, 2 or 3 spatial dims.

Each (batch, channel) plane is pooled on its own, so every leading dim may stay split (the
max-pool indices are positions inside a plane: a split of batch or channels leaves them
alone). The spatial dims must be whole.

Example:
    >>> pool_rule(op)   # max_pool2d x (4, 8, 6, 6) -> [R], [S(0) -> S(0)], [S(1) -> S(1)]
"""

from __future__ import annotations


from autopar.placement import Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, functional_overloads, register


# op packet name -> how many trailing dims it pools over
SPATIAL = {
    "max_pool1d": 1,
    "max_pool2d": 2,
    "max_pool3d": 3,
    "max_pool1d_with_indices": 1,
    "max_pool2d_with_indices": 2,
    "max_pool3d_with_indices": 3,
    "avg_pool1d": 1,
    "avg_pool2d": 2,
    "avg_pool3d": 3,
    "adaptive_avg_pool1d": 1,
    "adaptive_avg_pool2d": 2,
    "adaptive_avg_pool3d": 3,
    "_adaptive_avg_pool2d": 2,
    "_adaptive_avg_pool3d": 3,
    "adaptive_max_pool1d": 1,
    "adaptive_max_pool2d": 2,
    "adaptive_max_pool3d": 3,
    "lp_pool1d": 1,
    "lp_pool2d": 2,
    "lp_pool3d": 3,
}


def leading_dims_strategies(op: OpInfo, trailing: int) -> list[Strategy]:
    """Every dim before the last ``trailing`` split alike on the input and every output."""
    x = op.tensors[0]
    strategies = [op.replicated()]
    for d in range(x.ndim - trailing):
        if x.shape[d] > 1 and all(o.ndim == x.ndim for o in op.outputs):
            strategies.append(op.strategy({x: Shard(d)}, [Shard(d)] * len(op.outputs)))
    return strategies


def pool_rule(op: OpInfo) -> list[Strategy]:
    return leading_dims_strategies(op, SPATIAL[op.op.overloadpacket.__name__])


register(*functional_overloads(*SPATIAL))(pool_rule)
