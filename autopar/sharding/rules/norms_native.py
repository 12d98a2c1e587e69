"""The native forms of batch and group norm that export keeps when called directly
(``torch.native_batch_norm``, ``torch._native_batch_norm_legit``, ``torch._batch_norm_with_update``,
``torch.native_group_norm``): the same layouts as batch_norm.py's rules.

- batch norms: channels split (x S(1), per-channel weight, bias and running statistics S(0); the
  saved statistics S(0)); the batch split only where ``training`` is False (running statistics:
  exact), since training normalises with the whole batch's statistics;
- native_group_norm(x, w, b, N, C, HxW, group, eps): the batch split, with ``N`` made the local
  batch, or the channels in whole groups, with ``C`` and ``group`` made local (lowering
  ``group_norm_local``; mean and rstd (N, group) split with them).

Example:
    >>> native_batch_norm_rule(op)   # x (4, 6, 5) training -> [R], [S(1), S(0), S(0), R, R -> S(1), S(0), S(0)]
"""

from __future__ import annotations

import torch

from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.placement import Shard
from autopar.sharding.rules.batch_norm import _channel_split, _tensor
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten

# overload -> position of ``training`` (None: always training), per-channel tensors (position, name)
BATCH_NORMS = {
    aten.native_batch_norm.default: 5,
    aten._native_batch_norm_legit.default: 5,
    aten._native_batch_norm_legit.no_stats: 3,
    aten._batch_norm_with_update.default: None,
}
PER_CHANNEL = ((1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var"))


@register(*BATCH_NORMS)
def native_batch_norm_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    strategies = [op.replicated()]
    if x.ndim < 2:
        return strategies
    no_stats = op.op is aten._native_batch_norm_legit.no_stats
    per_channel = [_tensor(op, i, n) for i, n in PER_CHANNEL[: 2 if no_stats else 4]]
    if x.shape[1] > 1:
        strategies.append(_channel_split(op, per_channel))
    at = BATCH_NORMS[op.op]
    training = True if at is None else bool(op.arg(at, "training"))
    if not training and x.shape[0] > 1:
        outs = [Shard(0)] + [op.replicated().outputs[0]] * (len(op.outputs) - 1)  # saved statistics: empty
        strategies.append(op.strategy({x: Shard(0)}, outs, note="batch split, running statistics"))
    return strategies


class GroupNormLocal(Lowering):
    """native_group_norm with its size arguments the rank's: ``N`` on every axis splitting the
    batch, ``C`` and ``group`` on every axis splitting the channels (in whole groups)."""

    name = "group_norm_local"

    def emit(self, em, node, args, kwargs, axis: int):
        args = list(args)
        lay = node.meta["autopar"]
        for a, s in enumerate(lay.strategies):
            if s is None or s.lowering is not self:
                continue
            n = em.mesh.shape[a]
            if lay.input_targets[0][a] == Shard(0):
                args[3] = em.local_size(args[3], n)
            else:
                args[4], args[6] = em.local_size(args[4], n), em.local_size(args[6], n)
        return em.graph.call_function(node.target, tuple(args), kwargs)


GROUP_NORM_LOCAL = register_lowering(GroupNormLocal())


@register(aten.native_group_norm.default)
def native_group_norm_rule(op: OpInfo) -> list[Strategy]:
    x, groups = op.tensors[0], op.arg(6, "group")
    per_channel = [t for t in op.tensors[1:3]]
    strategies = [op.replicated()]
    if x.shape[0] > 1:
        strategies.append(op.strategy({x: Shard(0)}, [Shard(0)] * len(op.outputs), lowering=GROUP_NORM_LOCAL))
    if groups > 1:  # whole groups per rank: the propagator checks that ``group`` divides (mean, rstd dim 1)
        placed = {x: Shard(1)} | {t: Shard(0) for t in per_channel}
        strategies.append(
            op.strategy(placed, [Shard(1)] * len(op.outputs), lowering=GROUP_NORM_LOCAL, note="whole groups")
        )
    return strategies
