"""Measure the peak of live tensor bytes on CPU, where torch keeps no allocator statistics.

``LiveBytes`` is a TorchDispatchMode that sees every tensor an op returns, keeps a weak
reference to each new storage and, after every op, sums the current sizes of those alive: ``peak`` is the most bytes alive at once among
the tensors made inside the block, plus ``base`` (what was alive before: parameters,
optimizer state, passed in by the caller). Views share their base's storage and are not
counted twice; tensors made by C++ without a dispatched op (none in a training step) would
be missed.

Example:
    >>> with LiveBytes(base=bytes_of(module.parameters())) as mem:
    ...     loss_fn(module(x)).backward(); opt.step()
    >>> mem.peak
"""

from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def bytes_of(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


class LiveBytes(TorchDispatchMode):
    def __init__(self, base: int = 0):
        super().__init__()
        self.base, self.live, self.peak = base, 0, base
        self._storages: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {id(s) for s in _storages(pytree.tree_leaves((args, kwargs)))}
        out = func(*args, **(kwargs or {}))
        for s in _storages(pytree.tree_leaves(out)):
            if id(s) not in before:
                self._storages[id(s)] = s
        # current sizes, not sizes at creation: a storage resized to 0 (FSDP2 frees its gathered
        # parameters that way) counts as freed
        self.live = sum(s.nbytes() for s in list(self._storages.values()))
        self.peak = max(self.peak, self.base + self.live)
        return out


def _storages(leaves):
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse:
            try:
                yield t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                continue
