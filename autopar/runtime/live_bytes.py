"""Measure the peak of live tensor bytes on CPU, where torch keeps no allocator statistics.

``LiveBytes`` is a TorchDispatchMode that sees every tensor an op returns, counts the bytes
of each new storage once (keyed by its data pointer) and subtracts them when the storage is
freed (a weakref finalizer on the storage): ``peak`` is the most bytes alive at once among
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
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class LiveBytes(TorchDispatchMode):
    def __init__(self, base: int = 0):
        super().__init__()
        self.base, self.live, self.peak = base, 0, base
        self._known: dict[int, int] = {}
        self._existing: set[int] = set()

    def _free(self, ptr: int) -> None:
        self.live -= self._known.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr in self._known or ptr in before or s.nbytes() == 0:
                continue
            self._known[ptr] = s.nbytes()
            self.live += s.nbytes()
            weakref.finalize(s, self._free, ptr)
        self.peak = max(self.peak, self.base + self.live)
        return out
