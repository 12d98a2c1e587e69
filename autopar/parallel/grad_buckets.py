"""Gradient buckets: the parameters whose gradients are summed over the same mesh axes, fused
into flat buckets bounded by bytes and by count, in the order backward finishes them (the
same on every rank), and what one bucket's sync sends on a data-parallel axis.

Example:
    >>> for b in make_buckets(params, sync_axes, 25 * 2**20): print(b.names, b.nbytes)
    >>> bucket_sync(zero=2, n=4, wire_bytes=1024, param_bytes=1024)   # reduce-scatter, then all-gather
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.runtime.ring import DEFAULT_BUCKET_MB, ring_bytes

DEFAULT_FIRST_BUCKET_MB = 1.0  # as DDP: a small first bucket starts communication early


@dataclass
class Bucket:
    names: list[str]
    axes: tuple[int, ...]
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def make_buckets(
    params: dict[str, torch.nn.Parameter],
    sync_axes: dict[str, tuple[int, ...]],
    bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20),
    bucket_max_params: int | None = None,
    order: list[str] | None = None,
    first_bucket_bytes: int | None = None,
) -> list[Bucket]:
    """Deterministic buckets (same on every rank) for the parameters that need a sync.

    ``order``: parameter names in the order their gradients become ready (default: reverse
    registration order); names not in it follow in reverse registration order.
    ``first_bucket_bytes``: a smaller bound for the first bucket of each (axes, dtype).
    """
    names = [n for n in (order or []) if n in params]
    seen = set(names)
    names += [n for n in reversed(list(params)) if n not in seen]
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    closed: set[tuple] = set()
    for name in names:
        p = params[name]
        axes = sync_axes.get(name)
        if not axes or not p.requires_grad:
            continue
        key = (axes, p.dtype)
        b = open_.setdefault(key, Bucket([], axes, p.dtype, 0))
        b.names.append(name)
        b.numel += p.numel()
        first = first_bucket_bytes is not None and key not in closed
        full_bytes = b.numel * p.element_size() >= (min(bucket_bytes, first_bucket_bytes) if first else bucket_bytes)
        full_count = bucket_max_params is not None and len(b.names) >= bucket_max_params
        if full_bytes or full_count:
            done.append(open_.pop(key))
            closed.add(key)
    return done + list(open_.values())


def bucket_sync(zero: int, n, wire_bytes, param_bytes) -> list[tuple]:
    """(kind, phase, bytes per rank) of one bucket's sync on a data-parallel axis of size ``n``:
    ``wire_bytes`` of gradient on the wire, ``param_bytes`` of parameters (ZeRO all-gathers them
    after the step). The one definition the plan's collectives and the search's costs share."""

    sync = (
        ("reduce_scatter", "grad sync", ring_bytes("reduce_scatter", wire_bytes, n))
        if zero == 2
        else ("all_reduce", "grad sync", ring_bytes("all_reduce", wire_bytes, n))
    )
    gather = [("all_gather", "optimizer", ring_bytes("all_gather", param_bytes / n, n))] if zero else []
    return [sync] + gather
