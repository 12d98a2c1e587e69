"""Buffers kept equal across data-parallel ranks, as DDP's ``broadcast_buffers=True`` does.

The serial model has one copy of each buffer; under data parallelism every dp rank holds a
replica. Buffers the program writes (batch norm's running statistics and its batch counter)
would drift apart, each rank updating them from its own slice of the batch, and an eval
forward would then depend on the rank. DDP broadcasts rank 0's buffers at the start of
every forward; autopar broadcasts the first dp rank's buffers right *after* every training
forward that wrote them. The values are DDP's from then on (rank 0's chain of updates), and
the replicas are equal between forwards too, so an eval forward after the last training
step reads one copy on every rank (DDP under ``no_grad`` does not broadcast and reads each
rank's own).

- ``ap.DataParallel(axis, broadcast_buffers=False)`` is DDP's opt-out: each rank keeps the
  statistics of its own slices.
- ``ap.sync_batch_norm(model)`` normalises with the whole batch's statistics instead; its
  buffers are equal without a broadcast and are left out.
- Local SGD (``local_sgd_every``) trains each replica on its own between averagings: its
  buffers are not broadcast either.

One broadcast per dtype per training forward (the buffers laid end to end), over each dp
group from its first rank. Batch norm's backward in training mode reads the batch's
statistics it saved, not the running ones, so overwriting them after the forward leaves the
gradients as they are.

Example:
    >>> plan = ap.plan(resnet, ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp")
    >>> m = plan.module(r); m(x_local)          # running stats now rank 0's on both ranks
"""

from __future__ import annotations

import torch

from autopar.runtime.backend import current_backend
from autopar.runtime.eager import eager
from autopar.sharding.rules.batch_norm import SYNC_ATTR
from autopar.trace.written_buffers import written


def written_buffers(plan) -> list[str]:
    """Names of the buffers the program writes that every dp rank holds a replica of, except
    those of synced batch norms (equal on every rank already)."""
    dp = plan.data_parallel
    if dp is None or plan.dp_axis is None or not dp.broadcast_buffers or dp.local_sgd_every is not None:
        return []
    out = []
    for name in written(plan):
        path = name.rpartition(".")[0]
        if getattr(plan.model.get_submodule(path), SYNC_ATTR, False):
            continue
        spec = plan.param_specs.get(name)
        if spec is None or spec[plan.dp_axis].is_replicate():
            out.append(name)
    return out


def attach(plan, module: torch.nn.Module, rank: int) -> None:
    """A forward hook on ``module`` broadcasting its written buffers after training forwards
    (a pipeline stage module holds only its stage's)."""
    held = dict(module.named_buffers())
    names = [n for n in written_buffers(plan) if n in held]
    if not names or plan.mesh.shape[plan.dp_axis] == 1:
        return
    group = plan.mesh.group(plan.dp_axis, rank)

    @eager  # a collective on module state between compiled forwards
    def broadcast_after_forward(mod, args, output):
        if mod.training:
            broadcast_buffers([mod.get_buffer(n) for n in names], group, rank)

    module.register_forward_hook(broadcast_after_forward)


@torch.no_grad()
def broadcast_buffers(buffers: list[torch.Tensor], group: tuple, rank: int) -> None:
    """The group's first rank's values into ``buffers``: one flat broadcast per dtype."""
    backend = current_backend()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    for same in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in same])
        backend.broadcast(flat, group, rank)
        for b, piece in zip(same, flat.split([b.numel() for b in same])):
            # Autograd saved the running statistics with the batch norm it ran in training
            # mode, but that backward reads the batch's own statistics, not these: the copy
            # keeps the version counter, or backward would refuse the "modified" buffer.
            with torch.autograd._unsafe_preserve_version_counter(b):
                b.copy_(piece.view_as(b))
