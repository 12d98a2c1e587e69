"""Gradient sync: sum the gradients that arrive in parts (data parallel, and norms under
split activations) over their axes, fused into buckets and overlapped with backward.

Buckets are formed once, the same way on every rank: parameters in reverse registration
order (roughly the order backward produces their gradients), grouped by dtype and by the
axes to reduce over, closed when they pass ``bucket_bytes`` or ``bucket_max_params``. A
bucket's all-reduce is launched as soon as its last gradient has been accumulated; at the
end of backward every bucket is waited for once and the sums written back into ``.grad``.
Frozen parameters are left out; a parameter with no gradient in a step counts as zeros, so
every rank launches the same collectives and none waits forever.

Example:
    >>> sync = GradSync(module, {"fc.weight": (0,)}, mesh, rank)   # attach hooks
    >>> loss.backward()      # gradients of fc.weight are now summed over axis 0
    >>> with sync.no_sync(): loss2.backward()   # accumulate locally, sync on the next backward
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .collectives import current_backend


@dataclass
class Bucket:
    names: list[str]
    axes: tuple[int, ...]
    dtype: torch.dtype
    numel: int


def make_buckets(params: dict[str, torch.nn.Parameter], sync_axes: dict[str, tuple[int, ...]],
                 bucket_bytes: int = 25 * 2**20, bucket_max_params: int | None = None) -> list[Bucket]:
    """Deterministic buckets (same on every rank) for the parameters that need a sync."""
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    for name in reversed(list(params)):
        p = params[name]
        axes = sync_axes.get(name)
        if not axes or not p.requires_grad:
            continue
        key = (axes, p.dtype)
        b = open_.setdefault(key, Bucket([], axes, p.dtype, 0))
        b.names.append(name)
        b.numel += p.numel()
        full_bytes = b.numel * p.element_size() >= bucket_bytes
        full_count = bucket_max_params is not None and len(b.names) >= bucket_max_params
        if full_bytes or full_count:
            done.append(open_.pop(key))
    return done + list(open_.values())


class GradSync:
    """Hooks on a module's parameters that sum their gradients over the given mesh axes."""

    def __init__(self, module: torch.nn.Module, sync_axes: dict[str, tuple[int, ...]], mesh, rank: int,
                 bucket_bytes: int = 25 * 2**20, bucket_max_params: int | None = None):
        self.mesh, self.rank = mesh, rank
        self.params = dict(module.named_parameters())
        self.buckets = make_buckets(self.params, sync_axes, bucket_bytes, bucket_max_params)
        self.bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b.names}
        self.enabled = True
        self._reset()
        for name in self.bucket_of:
            self.params[name].register_post_accumulate_grad_hook(self._make_hook(name))

    def _reset(self):
        self.ready = [set() for _ in self.buckets]
        self.pending: dict[int, list] = {}
        self.callback_queued = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block syncs them all."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def _make_hook(self, name: str):
        def hook(param):
            if not self.enabled:
                return
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            i = self.bucket_of[name]
            self.ready[i].add(name)
            if len(self.ready[i]) == len(self.buckets[i].names):
                self._launch(i)
        return hook

    def _flat(self, bucket: Bucket) -> torch.Tensor:
        parts = []
        for n in bucket.names:
            p = self.params[n]
            parts.append(p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()))
        return torch.cat(parts)

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        flat = self._flat(bucket)
        backend = current_backend()
        works = []
        for axis in bucket.axes:  # summing over several axes = summing over each in turn
            group = self.mesh.group(axis, self.rank)
            works.append(backend.all_reduce_async(flat, group, self.rank))
            if len(bucket.axes) > 1:
                works[-1].wait()
        self.pending[i] = (flat, works)

    def _finish(self) -> None:
        for i in range(len(self.buckets)):
            if i not in self.pending:
                self._launch(i)  # some gradients were None this step: zeros stand in
        for i, (flat, works) in sorted(self.pending.items()):
            for w in works:
                w.wait()
            offset = 0
            for n in self.buckets[i].names:
                p = self.params[n]
                piece = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
        self._reset()
