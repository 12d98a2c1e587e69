"""Measure the peak of live tensor bytes on CPU, where torch keeps no allocator statistics.

``LiveBytes`` is a TorchDispatchMode that sees every tensor an op returns, keeps a weak
reference to each new storage and, after every op, sums the current sizes of those alive:
``peak`` is the most bytes alive at once among the tensors made inside the block, plus
``base`` (what was alive before: parameters, optimizer state, passed in by the caller).
Views share their base's storage and are not counted twice.

Two things no op shows, and how they are counted:

- ``watch``: storages made before the block whose size changes outside any op. torch FSDP2
  keeps its unsharded parameters in storages it resizes to 0 after use and back before the
  next all-gather (``UntypedStorage.resize_``, not a dispatched op); they count at their
  current size after every op, so a gathered block is not invisible.
- Host copies (activations an offloading checkpoint keeps until backward) are not device
  bytes: whoever makes one registers its storage here (``register_host``: activation
  checkpointing's offload, parallel/activation_checkpoint/offload.py), and ``live`` and ``peak``
  leave them out, ``host`` and ``host_peak`` count the host copies made inside the block (on a
  CPU run too, where "host" is the same memory: the split is what a GPU step would hold on each
  side).
- An observer, not a transform: the mode is marked ``observer`` and autopar's programs keep
  their eager fast paths under it (runtime/collectives.plain_eager), so what is measured is
  what an unobserved step allocates.

Example:
    >>> with LiveBytes(base=bytes_of(module.parameters())) as mem:
    ...     loss_fn(module(x)).backward(); opt.step()
    >>> mem.peak
    >>> mem.refresh().live        # bytes alive now (``live`` is as of the last op)
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# id(storage) -> storage, for the host copies alive (a storage's Python object is kept with it);
# also per thread: the simulator runs every rank in one process, one thread each
_HOST: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_MINE = threading.local()


def register_host(storage) -> None:
    """Count ``storage`` as a host copy (not device bytes) while it is alive."""
    _HOST[id(storage)] = storage
    _mine()[id(storage)] = storage


def is_host(storage) -> bool:
    """Whether ``storage`` is a host copy registered by ``register_host``."""
    return _HOST.get(id(storage)) is storage


def host_storages() -> list:
    """The host copies this thread registered that are alive now."""
    return list(_mine().values())


def _mine() -> weakref.WeakValueDictionary:
    if not hasattr(_MINE, "storages"):
        _MINE.storages = weakref.WeakValueDictionary()
    return _MINE.storages


def bytes_of(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


class LiveBytes(TorchDispatchMode):
    observer = True  # only looks: plain_eager() stays True under it

    def __init__(self, base: int = 0, watch=()):
        super().__init__()
        self._storages: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> storage
        for s in watch:
            self._storages[id(s)] = s
        self._host_before = {id(s) for s in host_storages()}
        self.base, self.live, self.host = base, self._live(), self._host()
        self.peak, self.host_peak = base + self.live, self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {id(s) for s in _storages(pytree.tree_leaves((args, kwargs)))}
        out = func(*args, **(kwargs or {}))
        for s in _storages(pytree.tree_leaves(out)):
            if id(s) not in before:
                self._storages[id(s)] = s
        self.live, self.host = self._live(), self._host()
        self.peak = max(self.peak, self.base + self.live)
        self.host_peak = max(self.host_peak, self.host)
        return out

    def refresh(self) -> "LiveBytes":
        """Count again now: ``live`` and ``host`` are as of the last op, and what died since
        (a model's outputs the caller dropped after the last op) is still in them."""
        self.live, self.host = self._live(), self._host()
        return self

    def _live(self) -> int:
        # current sizes, not sizes at creation: a storage resized to 0 (FSDP2 frees its gathered
        # parameters that way) counts as freed, and resized back as alive again
        return sum(s.nbytes() for s in list(self._storages.values()) if not is_host(s))

    def _host(self) -> int:
        return sum(s.nbytes() for s in host_storages() if id(s) not in self._host_before)


def _storages(leaves):
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse:
            try:
                yield t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                continue
