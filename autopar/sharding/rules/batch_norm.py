"""Batch, group and instance norm over channel dim 1 of (N, C, *spatial).

- channels split: x S(1), weight, bias and running statistics S(0) -> out S(1): exact.
- batch split: x S(0) -> out S(0). Exact in eval mode (running statistics). In training mode
  each rank normalises its slice with its own batch statistics, as DDP does, unless the
  module was marked with ``ap.sync_batch_norm(model)``: then the lowering ``batch_norm_sync``
  all-reduces the per-channel sums over the batch-split axes (forward and backward, as
  torch's SyncBatchNorm) and the result, running statistics included, equals serial.
- group_norm: batch split; channels split in whole groups (lowering ``group_norm_groups``).
- instance_norm: each (sample, channel) on its own: batch and channels split.

Example:
    >>> ap.sync_batch_norm(model)         # opt in: every BatchNorm equals the serial model's
    >>> plan = ap.plan(model, mesh, args=(x,), data_parallel="dp")
"""

from __future__ import annotations

import torch

from autopar.errors import ShardingError
from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.sharding.lowerings.train_modes import follows_mode, lower_batch_norm, training
from autopar.runtime.ring import ring_bytes
from autopar.placement import Shard

from autopar.sharding.rules.registry import OpInfo, Strategy, declare, register
from autopar.trace.module_paths import module_path

aten = torch.ops.aten
ops = torch.ops.autopar
SYNC_ATTR = "_autopar_sync_batch_norm"


def sync_batch_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Mark every BatchNorm of ``model`` to normalise with the statistics of the whole batch
    under any plan (as torch.nn.SyncBatchNorm does); returns ``model``."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            setattr(m, SYNC_ATTR, True)
    return model


def _channel_split(op: OpInfo, per_channel: list) -> Strategy:
    placed = {op.tensors[0]: Shard(1)} | {t: Shard(0) for t in per_channel if t is not None}
    return op.strategy(placed, [Shard(1)] + [Shard(0)] * (len(op.outputs) - 1))


def _tensor(op: OpInfo, i: int, name: str):
    t = op.arg(i, name)
    return t if t is not None and any(t is m for m in op.tensors) else None


# batch norm follows train()/eval() on every strategy (running or batch statistics)
declare(aten.batch_norm.default, mode=lower_batch_norm)


@register(aten.batch_norm.default, aten.instance_norm.default)
def batch_norm_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    strategies = [op.replicated()]
    if x.ndim < 2:
        return strategies
    per_channel = [_tensor(op, i, n) for i, n in ((1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var"))]
    if x.shape[1] > 1:
        strategies.append(_channel_split(op, per_channel))
    if x.shape[0] > 1:
        # the lowering decides at run time: the module's train()/eval() picks batch or running statistics
        lowering = BATCH_NORM_SYNC if op.op is aten.batch_norm.default else None
        strategies.append(op.strategy({x: Shard(0)}, Shard(0), lowering=lowering, note="batch split"))
    return strategies


@register(aten.group_norm.default)
def group_norm_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    strategies = [op.replicated()]
    if x.shape[0] > 1:
        strategies.append(op.strategy({x: Shard(0)}, Shard(0), note="batch split"))
    if x.ndim > 1 and x.shape[1] > 1:
        per_channel = [_tensor(op, 2, "weight"), _tensor(op, 3, "bias")]
        placed = {x: Shard(1)} | {t: Shard(0) for t in per_channel if t is not None}
        strategies.append(op.strategy(placed, Shard(1), lowering=GROUP_NORM_GROUPS, note="whole groups"))
    return strategies


def _split_factor(em, node, lowering, axes_out: list | None = None) -> int:
    n = 1
    for a, s in enumerate(node.meta["autopar"].strategies):
        if s is not None and s.lowering is lowering:
            n *= em.mesh.shape[a]
            if axes_out is not None:
                axes_out.append(a)
    return n


class GroupNormGroups(Lowering):
    """group_norm with its channels split in whole groups: each rank normalises groups / n."""

    name = "group_norm_groups"

    def emit(self, em, node, args, kwargs, axis: int):
        return _group_norm_groups(em, node, args, kwargs)


class BatchNormSync(Lowering):
    """Training-mode batch norm on a batch split: local statistics (DDP), or, when the module
    is marked with sync_batch_norm, the whole batch's statistics (all-reduced sums)."""

    name = "batch_norm_sync"

    def emit(self, em, node, args, kwargs, axis: int):
        return _batch_norm_sync(em, node, args, kwargs)

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        if not _marked(plan.model, node):
            return []
        lay = node.meta["autopar"]
        val = node.args[0].meta["val"]
        nbytes = 2 * val.shape[1] * val.dtype.itemsize  # per-channel sum and sum of squares
        axes = [a for a, s in enumerate(lay.strategies) if s is not None and s.lowering is self]
        return [
            (kind, a, phase, ring_bytes("all_reduce", nbytes, symbols.axes[a]))
            for a in axes
            for kind, phase in (("all_reduce", "forward"), ("all_reduce", "backward"))
        ]

    def reason(self, axis_name: str) -> str:
        return (
            f"synchronised batch norm: per-channel sums all-reduced over {axis_name} so that every rank "
            "normalises with the whole batch's statistics, as serial does"
        )


GROUP_NORM_GROUPS = register_lowering(GroupNormGroups())
BATCH_NORM_SYNC = register_lowering(BatchNormSync())


def _marked(model, node) -> bool:

    path = module_path(node)
    module = model.get_submodule(path) if path else model
    return bool(getattr(module, SYNC_ATTR, False))


def _group_norm_groups(em, node, args, kwargs):
    n = _split_factor(em, node, GROUP_NORM_GROUPS)
    args = list(args)
    if args[1] % n:
        raise ShardingError(
            f"node {node.name!r}: group_norm with {args[1]} groups cannot split its channels "
            f"over {n} ranks in whole groups; replicate its channels or use fewer ranks."
        )
    args[1] //= n
    return em.graph.call_function(node.target, tuple(args), kwargs)


def _batch_norm_sync(em, node, args, kwargs):
    if not _marked(em.plan.model, node) or len(args) < 8 or not isinstance(args[5], bool):
        return lower_batch_norm(em, node, args, kwargs)  # each rank's own statistics (as DDP)
    axes: list = []
    ranks = _split_factor(em, node, BATCH_NORM_SYNC, axes)
    g = em.graph
    x, w, b, rm, rv, _, momentum, eps = list(args[:8])
    sums = g.call_function(_local_sums, (x,))
    for a in axes:  # all-reduce forward and backward: every rank's loss uses the global sums
        sums = em.collective(ops.grad_all_reduce.default, (sums,), a)
        sums = em.collective(ops.all_reduce.default, (sums,), a, ("sum",))
    train = training(em) if follows_mode(em, node, args[5]) else args[5]
    return g.call_function(_normalise, (x, sums, ranks, w, b, rm, rv, momentum, eps, train))


def _local_sums(x: torch.Tensor) -> torch.Tensor:
    """(2, C): the per-channel sum and sum of squares of this rank's slice."""
    dims = [d for d in range(x.dim()) if d != 1]
    return torch.stack([x.sum(dims), (x * x).sum(dims)])


def _normalise(x, sums, ranks, w, b, rm, rv, momentum, eps, train=True):
    if not train and rm is not None:  # eval: running statistics, left unchanged (the sums go unused)
        return torch.nn.functional.batch_norm(x, rm, rv, w, b, False, momentum, eps)
    count = x.numel() // x.shape[1] * ranks
    mean = sums[0] / count
    var = (sums[1] / count - mean * mean).clamp_min(0)
    if rm is not None:
        with torch.no_grad():
            rm.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            rv.mul_(1 - momentum).add_(var.detach() * count / max(count - 1, 1), alpha=momentum)
    shape = [1, -1] + [1] * (x.dim() - 2)
    out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    if w is not None:
        out = out * w.view(shape)
    if b is not None:
        out = out + b.view(shape)
    return out
