"""The memory counter (runtime/live_bytes.py): it counts what a step allocates, sees storages
resized outside any op (torch FSDP2 frees its gathered parameters that way), and, being an
observer, leaves autopar's eager fast paths on (what it measures is the unobserved step)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.collectives import plain_eager
from autopar.runtime.live_bytes import LiveBytes


class _Recorder(TorchDispatchMode):  # a mode that is not an observer (as make_fx's would be)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_counts_new_tensors_and_frees():
    with LiveBytes(base=100) as mem:
        a = torch.empty(1000)  # 4000 bytes
        del a
        b = torch.empty(500)
    assert mem.peak == 100 + 4000
    assert mem.live == 2000 and b.numel() == 500


def test_watched_storage_counts_at_its_current_size():
    held = torch.empty(1000)
    storage = held.untyped_storage()
    storage.resize_(0)  # as FSDP2 frees an unsharded parameter
    with LiveBytes(watch=[storage]) as mem:
        storage.resize_(4000)  # not a dispatched op: only the watch sees it
        torch.empty(1)
        storage.resize_(0)
        torch.empty(1)
    assert mem.peak == 4000 + 4
    assert mem.live == 4  # resized to 0 counts as freed


def test_unwatched_resize_is_invisible():
    held = torch.empty(1000)
    storage = held.untyped_storage()
    storage.resize_(0)
    with LiveBytes() as mem:
        storage.resize_(4000)
        torch.empty(1)
    assert mem.peak == 4  # why the FSDP2 benchmark passes watch=


def test_observer_keeps_the_eager_fast_paths():
    assert plain_eager()
    with LiveBytes():
        assert plain_eager()
    with _Recorder():
        assert not plain_eager()  # a recording mode must see functional ops
    with LiveBytes(), _Recorder():
        assert not plain_eager()


def test_views_of_earlier_tensors_are_not_new_bytes():
    """A step's transposed weights (``w.t()``, saved for backward) view the parameters' storage:
    they are in ``base``, not step memory (bench_memory's own counter once counted them)."""
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)
    with LiveBytes() as mem:
        y = x @ w.t()
        wt = w.t()
    assert mem.peak == y.numel() * 4
    assert wt.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
