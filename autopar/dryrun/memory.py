"""Device bytes counted at every allocation of a program run on fake tensors.

``MemoryCounter`` is a dispatch mode stacked over a FakeTensorMode: each op's outputs that
bring a storage not seen before add its bytes, under the kind the run is in at that moment
(``kind``: "activations" in forward, "temporaries" in backward, "communication" inside a
collective, "optimizer_state" in the optimizer's step), and the storage's death (a weak
reference's callback) takes them off. What is known to be a parameter, a gradient or an
optimizer's state is moved to that kind (``label``) as soon as it is known. ``peak`` is the
largest total seen and ``peak_by_kind`` the kinds' bytes at that moment, as torch's
MemTracker reports them, but without module hooks: a rank program is one GraphModule.

Example:
    >>> with FakeTensorMode(), MemoryCounter() as mem:
    ...     y = torch.empty(1024, device="cuda") * 2
    >>> mem.peak                        # 8192: the input and the product
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.collectives import collective_kernel


class MemoryCounter(TorchDispatchMode):
    def __init__(self, device=None):
        super().__init__()
        self.device = None if device is None else torch.device(device)  # None: every device's bytes
        self.live: dict[int, tuple] = {}  # storage key -> (weakref, bytes, kind)
        self.by_kind: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.peak_by_kind: dict[str, int] = {}
        self.kind_stack: list[str] = []

    # ----------------------------------------------------------------------- the count
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kernel = collective_kernel(func)
        if kernel is not None:  # the collective itself, on the backend (counted, recorded), not its fake
            with self, self.kind("communication"):
                out = kernel(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, self.current_kind())
        return out

    def current_kind(self) -> str:
        if self.kind_stack:
            return self.kind_stack[-1]
        return "temporaries" if torch._C._current_graph_task_id() != -1 else "activations"

    def track(self, t: torch.Tensor, kind: str) -> None:
        """Count ``t``'s storage once, under ``kind``, until it dies (host tensors, such as Adam's
        step counts, are not the device's)."""
        if self.device is not None and t.device != self.device:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        nbytes = st.nbytes()
        ref = weakref.ref(st, lambda _, key=key: self._free(key))
        self.live[key] = (ref, nbytes, kind)
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak, self.peak_by_kind = self.total, dict(self.by_kind)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.by_kind[entry[2]] -= entry[1]
            self.total -= entry[1]

    def label(self, tensors, kind: str) -> None:
        """``tensors`` are of ``kind`` (parameters, gradients, optimizer state): counted there from
        now on (tracked first if they are new), and at the peak too where the peak is now."""
        at_peak = self.total == self.peak
        for t in tensors:
            if not isinstance(t, torch.Tensor) or (self.device is not None and t.device != self.device):
                continue
            key = t.untyped_storage()._cdata
            if key not in self.live:
                self.track(t, kind)
                continue
            ref, nbytes, old = self.live[key]
            if old != kind:
                self.by_kind[old] -= nbytes
                self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
                self.live[key] = (ref, nbytes, kind)
        if at_peak:
            self.peak_by_kind = dict(self.by_kind)

    def reset_peak(self) -> None:
        """The peak from now on (what was counted before, e.g. building the module, left out)."""
        self.peak, self.peak_by_kind = self.total, dict(self.by_kind)

    @contextlib.contextmanager
    def kind(self, kind: str):
        """Allocations in this block are of ``kind`` (a collective's buffers, the optimizer's step)."""
        self.kind_stack.append(kind)
        try:
            yield
        finally:
            self.kind_stack.pop()
