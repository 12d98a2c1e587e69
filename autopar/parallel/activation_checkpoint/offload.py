"""Activations held in host memory until backward (``ActivationCheckpoint(offload=True)``).

Two kinds of tensor a checkpointed region keeps go to the host (recompute.py):

- the region's inputs that autograd made (checkpoint keeps them for the recompute), and
- under a selective policy, the outputs of the ops it keeps (matmuls, attention, collectives):
  torch's selective checkpoint caches them in a dict until the recompute asks for them;
  ``HostCache`` is that dict with each tensor copied to the host on the way in and back to its
  device on the way out.

``to_host`` copies into pinned memory where CUDA exists (the copy overlaps the next kernels);
on a CPU run it copies into a separate host storage all the same, so that a CPU step holds
what a GPU step would hold on each side. Host storages are registered (weakly) with
runtime/live_bytes.py (``register_host``), whose ``LiveBytes`` counts them as ``host`` bytes, not
device bytes; the copy itself runs below every dispatch mode (an observer, the policy's mode), so
it is neither counted as a device allocation nor recorded by the policy. ``to_device`` is an ordinary op
(its copy is a device allocation, and LiveBytes sees it).

Prefetch: in backward, the recompute of region k asks for its own copies back and then starts
those of region k - 1 (the region before it in the same forward: the next one backward
recomputes), ``Ahead``: on CUDA on a side stream, from pinned memory, non-blocking, so the copy
overlaps region k's recompute and backward; the stream that uses them waits for the side
stream's event (and the copies are recorded on it for the allocator). Only for the device types
in ``PREFETCH``: on a CPU a copy is a synchronous memcpy on the thread that runs backward, with
nothing to overlap it with; made early it would only hold region k - 1's bytes during region
k's backward, so there it runs when the recompute asks (the tests add "cpu" to run the
prefetching path, which must give the same step).

Example:
    >>> h = to_host(x)                              # x's bytes now live on the host
    >>> live_bytes.is_host(h.untyped_storage())     # True
    >>> y = to_device(h, x.device)                  # back for the recompute (a new device tensor)
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from autopar.runtime.live_bytes import register_host


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``x`` in host memory (pinned where CUDA exists), registered as host
    (runtime/live_bytes.register_host)."""
    pinned = torch.cuda.is_available()
    with _disable_current_modes(), torch.no_grad():  # x's strides kept: the recompute's ops (a
        # reshape that copies a transposed tensor, not a contiguous one) must run as the forward's
        host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu", pin_memory=pinned)
        host.copy_(x.detach(), non_blocking=pinned)
    register_host(host.untyped_storage())
    return host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` copied back to ``device`` with its strides (differentiable; on the CPU a new
    storage, as on a GPU)."""
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    return out.copy_(host, non_blocking=device.type != "cpu")


# device types whose copies back start ahead of the recompute that needs them (see the docstring)
PREFETCH = {"cuda"}


def prefetching(device: torch.device) -> bool:
    return device.type in PREFETCH


class Ahead:
    """Copies of host tensors back to ``device`` started now, ahead of need: on CUDA on a side
    stream (``take`` makes the stream that uses a copy wait for them), elsewhere made at once.

    Example:
        >>> ahead = Ahead({0: h}, torch.device("cuda"))   # the copy runs while backward goes on
        >>> x = ahead.take(0)                             # later: ready on the current stream
    """

    def __init__(self, hosts: dict, device: torch.device):
        self.device, self.event = device, None
        if device.type == "cuda":
            side = _side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the host copies were made on it
            with torch.cuda.stream(side):
                self.copies = {k: to_device(h, device) for k, h in hosts.items()}
            self.event = side.record_event()
        else:
            self.copies = {k: to_device(h, device) for k, h in hosts.items()}

    def __contains__(self, k) -> bool:
        return k in self.copies

    def take(self, k) -> torch.Tensor:
        t = self.copies.pop(k)
        if self.event is not None:
            now = torch.cuda.current_stream(self.device)
            now.wait_event(self.event)
            t.record_stream(now)  # made on the side stream, used on this one: not reused before
        return t


_SIDE: dict = {}  # device -> the stream prefetches copy on


def _side_stream(device: torch.device):
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class _OnHost:
    """A cached output of the selective policy, in host memory; ``get_val`` (what torch's
    recompute mode calls on a cache entry) brings it back to its device."""

    __slots__ = ("host", "device", "ahead")

    def __init__(self, tensor: torch.Tensor):
        self.host, self.device, self.ahead = to_host(tensor), tensor.device, None

    def prefetch(self) -> None:
        """Start the copy back now (the region's recompute comes next: ``Ahead``)."""
        if self.ahead is None and prefetching(self.device):
            self.ahead = Ahead({0: self.host}, self.device)

    def get_val(self, allow_cache_entry_mutation=False):
        ahead, self.ahead = self.ahead, None
        return ahead.take(0) if ahead is not None else to_device(self.host, self.device)


class _HostSlots(dict):
    """One op's cache entries (invocation index -> entry), tensors stored on the host. An entry
    is a pytree of torch's version wrappers (``.val``, ``.get_val``) or a marker (recompute,
    consumed), which passes through."""

    def __setitem__(self, idx, entry):
        def move(leaf):
            val = getattr(leaf, "val", None)
            return _OnHost(val) if hasattr(leaf, "get_val") and isinstance(val, torch.Tensor) else leaf

        super().__setitem__(idx, pytree.tree_map(move, entry))


def cached_on_host(cache) -> list:
    """The host entries of a ``host_cache`` (to prefetch them)."""
    return [leaf for slots in cache.values() for entry in slots.values() for leaf in pytree.tree_leaves(entry)
            if isinstance(leaf, _OnHost)]  # fmt: skip


def host_cache() -> defaultdict:
    """The storage of torch's selective checkpoint contexts with every cached tensor on the host
    (op -> {invocation index -> entry}, as ``create_selective_checkpoint_contexts`` makes it)."""
    return defaultdict(_HostSlots)
