"""Gradient sync: sum the gradients that arrive in parts (data parallel, and norms under
split activations) over their axes, fused into buckets and overlapped with backward.

Buckets are formed the same way on every rank: parameters in the order backward finishes
their gradients (the reverse of their first use in the forward graph), grouped by dtype and
by the axes to reduce over, closed when they reach ``bucket_bytes`` or ``bucket_max_params``.
After the first synced backward they are formed again from the order the gradients really
arrived, as DDP rebuilds its buckets (every rank runs the same program, so every rank sees
the same order); ZeRO-1/2 keep the first buckets, which their parameter shards are laid out by.

Gradients live in their buckets, as DDP's ``gradient_as_bucket_view``: each bucket owns one
flat buffer and each parameter's ``.grad`` is a view of its slot, so the collective reduces
the gradients in place and nothing is concatenated or copied back. A gradient autograd
made afresh (after ``zero_grad(set_to_none=True)``, torch's default) is copied into its slot
once, in the hook, and ``.grad`` becomes the view again; with ``set_to_none=False`` autograd
accumulates into the views directly. A bucket's collective is launched as soon as its last
gradient has been accumulated, strictly in bucket order (bucket i+1 never goes before bucket
i, so every rank issues the same sequence even if some gradient is late or missing); at the
end of backward every bucket is waited for once. The 1/n of the mean over the data-parallel
ranks is folded into the loss (the emitted program's ``scale_grad`` on outputs), so the sum
is the gradient, with no per-gradient division. Frozen parameters are left out; a parameter
with no gradient in a step counts as zeros, so every rank launches the same collectives and
none waits forever. A parameter frozen after the buckets were made (``requires_grad_(False)``
on the rank module, as fine-tuning code does after set-up) still has its zeros in its bucket,
but gets no ``.grad``: an optimizer with weight decay must not move it.

On the data-parallel axis the ap.DataParallel options apply: ``reduce_dtype`` (one cast per
bucket into a wire buffer kept for it, one back), ``zero=1`` (all-reduce, then the
optimizer of the storage's ``grad_shards`` steps this rank's slice, a view of the bucket),
``zero=2`` (the shards' ``reduce_scatters``: the bucket's buffer is made for the step when
its first gradient arrives, each gradient is copied in and freed at once, the buffer goes
after the launch and only this rank's reduced slice is kept), ``local_sgd_every`` (no collective: each rank keeps its own gradient). Other
axes get a plain all-reduce.

Example:
    >>> sync = GradSync(module, {"fc.weight": (0,)}, mesh, rank)   # attach hooks
    >>> loss.backward()      # gradients of fc.weight are now summed over axis 0
    >>> with sync.no_sync(): loss2.backward()   # accumulate locally, sync on the next backward
"""

from __future__ import annotations

import contextlib
import operator

import torch

from autopar.runtime.backend import current_backend
from autopar.parallel.grad_buckets import DEFAULT_BUCKET_MB, Bucket, make_buckets

_GRAD = operator.attrgetter("grad")


def _each_is(grads: list, views: list, nones: list) -> bool:
    """Whether each gradient is its view or None (in C: no Python frame per parameter)."""
    return sum(map(operator.is_, grads, views)) + sum(map(operator.is_, grads, nones)) == len(grads)


class _Slots:
    """A bucket at run time: its parameters, its flat gradient buffer and each one's view of it.

    ``flat`` is kept for the module's life, except under ZeRO-2 (``per_step``), where it is
    made when the bucket's first gradient arrives and dropped once its reduce-scatter is
    launched; ``views`` are then None and ``adopted`` holds who has been copied in this step.
    """

    __slots__ = ("params", "nones", "sizes", "starts", "flat", "views", "wire", "per_step", "adopted", "numel", "dtype")

    def __init__(self, params: list, numel: int, dtype, per_step: bool, wire_dtype, pad_to: int):
        self.params, self.sizes, self.per_step, self.adopted = params, [p.numel() for p in params], per_step, set()
        self.nones = [None] * len(params)  # what their .grad read after zero_grad(set_to_none=True)
        self.starts = [sum(self.sizes[:j]) for j in range(len(params))]
        self.numel, self.dtype = max(pad_to, numel), dtype if wire_dtype is None or not per_step else wire_dtype
        self.flat, self.views, self.wire = None, None, None
        if not per_step:
            first = params[0]
            self.flat = torch.zeros(self.numel, dtype=dtype, device=first.device)
            self.views = [v.view_as(p) for v, p in zip(self.flat[:numel].split(self.sizes), params)]
            if wire_dtype is not None and wire_dtype != dtype:
                self.wire = torch.empty(self.numel, dtype=wire_dtype, device=first.device)

    def make_flat(self) -> torch.Tensor:
        """ZeRO-2's buffer for this step (its padding zeroed: every rank's slice is summed)."""
        first = self.params[0]
        flat = torch.empty(self.numel, dtype=self.dtype, device=first.device)
        used = sum(self.sizes)
        if used < self.numel:
            flat[used:].zero_()
        self.flat = flat
        return flat

    def slot(self, j: int) -> torch.Tensor:
        at = self.starts[j]
        return self.flat[at : at + self.sizes[j]].view_as(self.params[j])


class GradSync:
    """Hooks on a module's parameters that sum their gradients over the given mesh axes."""

    def __init__(
        self,
        module: torch.nn.Module,
        sync_axes: dict[str, tuple[int, ...]],
        mesh,
        rank: int,
        bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20),
        bucket_max_params: int | None = None,
        dp=None,  # the plan's ap.DataParallel
        dp_axis: int | None = None,
        order: list[str] | None = None,
    ):
        self.mesh, self.rank, self.dp, self.dp_axis = mesh, rank, dp, dp_axis
        first = None
        if dp is not None:
            bucket_bytes, bucket_max_params, first = dp.bucket_bytes, dp.bucket_max_params, dp.first_bucket_bytes
        self.sync_axes, self.limits = sync_axes, (bucket_bytes, bucket_max_params, first)
        self.params = dict(module.named_parameters())
        self.buckets = make_buckets(self.params, sync_axes, bucket_bytes, bucket_max_params, order, first)
        self.enabled = True
        # each rank's slices of the dp buckets where the storage steps slices (ZeRO-1/2's), else None;
        # asked before the buckets are made: whether they are reduce-scattered decides their buffers
        self.shards = dp.grad_shards() if dp is not None else None
        self.handles: list = []  # the parameters' hooks (made again when the buckets are rebuilt)
        self._build()
        if self.shards is not None:
            self.shards.bind(self, [i for i, b in enumerate(self.buckets) if self.on_dp(b)])
        # the first synced backward records the order gradients arrive in, to rebuild the buckets
        # (not where shards were laid out by the first buckets)
        self.arrived: list[str] | None = [] if self.shards is None else None
        self._reset()
        self.held: set[int] = set()  # buckets whose .grad hold synced sums (no zero_grad since)
        module.register_forward_pre_hook(self._rescale_held)

    def _build(self) -> None:
        """The buckets' run-time state: flat buffers, views, and where each parameter goes."""
        self.slots, self.where, self.modes, self.groups = [], {}, [], []
        self.folded = [self.dp_axes(b) for b in self.buckets]  # reduced as one group (dp, or dp x cp)
        for i, b in enumerate(self.buckets):
            mode = self._mode(b)
            group = self.dp_group(b) if mode != "none" else None
            n = len(group) if group is not None else 1
            pad_to = -(-b.numel // n) * n if mode == "reduce_scatter" else 0
            wire = self.dp.reduce_dtype if mode in ("all_reduce", "reduce_scatter") else None
            slots = _Slots(
                [self.params[name] for name in b.names], b.numel, b.dtype, mode == "reduce_scatter", wire, pad_to
            )
            self.slots.append(slots)
            self.modes.append(mode)
            self.groups.append(group)
            for j, name in enumerate(b.names):
                self.where[name] = (i, j, slots.views[j] if slots.views is not None else None)
        self.need = [len(b.names) for b in self.buckets]
        self.factors = [self.factor(b) for b in self.buckets]
        for handle in self.handles:
            handle.remove()
        self.handles = [
            self.params[name].register_post_accumulate_grad_hook(self._make_hook(name, *self.where[name]))
            for name in self.where
        ]

    # -------------------------------------------------------------------------- queries
    def dp_axes(self, bucket: Bucket) -> tuple:
        """The bucket's axes the data-parallel options reduce, as one group: dp, or dp x cp where
        ZeRO-1/2 fold cp in (``DataParallel.group_axes``); () for none."""
        if self.dp is not None:
            return self.dp.group_axes(self.mesh, bucket.axes)
        return (self.dp_axis,) if self.dp_axis is not None and self.dp_axis in bucket.axes else ()

    def on_dp(self, bucket: Bucket) -> bool:
        return bool(self.dp_axes(bucket))

    def dp_group(self, bucket: Bucket | None = None) -> tuple[int, ...]:
        """The ranks of the dp axis (a bucket's: of its ``dp_axes``, dp x cp folded)."""
        axes = (self.dp_axis,) if bucket is None else self.dp_axes(bucket)
        return self.mesh.group(axes[0] if len(axes) == 1 else axes, self.rank)

    def _mode(self, bucket: Bucket) -> str:
        """How the bucket is reduced on the dp axis: none | all_reduce | reduce_scatter | local."""
        if not self.on_dp(bucket):
            return "none"
        if self.dp is not None and self.dp.local_sgd_every is not None:
            return "local"
        return "reduce_scatter" if self.shards is not None and self.shards.reduce_scatters else "all_reduce"

    def factor(self, bucket: Bucket) -> int:
        """How many rank-parts the bucket's sync adds up (the product of its groups' sizes)."""
        out = 1
        for axis in bucket.axes:  # a SubAxis: its replica groups (Mesh.group)
            out *= len(self.mesh.group(axis, self.rank))
        return out

    # ---------------------------------------------------------------------------- hooks
    def _rescale_held(self, module, args) -> None:
        """Gradients kept from a synced backward (no zero_grad) would be summed again with the
        new parts: divide them by the number of parts first, so the next sync adds them once
        (one division per bucket where its gradients are still its views). After
        zero_grad(set_to_none=True) nothing is held: the check runs in C (map, any), no Python
        frame per parameter."""
        if not self.held or not torch.is_grad_enabled():
            return
        held = []
        for i in self.held:
            grads = list(map(_GRAD, self.slots[i].params))
            if any(map(operator.is_not, grads, self.slots[i].nones)):
                held.append((i, grads))
        self.held.clear()
        if not held:
            return
        with torch.no_grad():
            for i, grads in held:
                slots = self.slots[i]
                if slots.views is not None and _each_is(grads, slots.views, slots.nones):
                    slots.flat.div_(self.factors[i])  # the None slots are overwritten or zeroed anyway
                    continue
                for g in grads:
                    if g is not None:
                        g.div_(self.factors[i])

    def _reset(self):
        self.ready = [0] * len(self.buckets)
        self.next = 0  # the next bucket to launch: buckets go strictly in order
        self.pending: list[tuple] = []
        self.zeroed: set[int] = set()  # buckets launched with zeros for missing gradients
        self.callback_queued = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block syncs them all."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def _make_hook(self, name: str, i: int, j: int, view):
        """The hook of parameter ``name``, slot ``j`` of bucket ``i`` (``view``: its slot, None
        under ZeRO-2): one Python call per gradient, what it needs bound in."""

        def hook(param):
            if not self.enabled:
                return
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if view is None:  # ZeRO-2: into this step's buffer
                self._adopt(i, j, param)
            elif param.grad is not view:  # made afresh by autograd (in backward: grad mode is off)
                view.copy_(param.grad)
                param.grad = view
            if self.arrived is not None:
                self.arrived.append(name)
            ready = self.ready
            ready[i] += 1
            if i == self.next and ready[i] == self.need[i]:
                self._launch_ready()

        return hook

    def _adopt(self, i: int, j: int, param) -> None:
        """ZeRO-2: copy the gradient autograd made into this step's buffer of bucket ``i`` (slot
        ``j``) and drop it: only this rank's reduced slice is kept."""
        slots = self.slots[i]
        if slots.flat is None:
            slots.make_flat()
        slots.slot(j).copy_(param.grad)
        slots.adopted.add(j)
        param.grad = None

    def _launch_ready(self) -> None:
        while self.next < len(self.buckets) and self.ready[self.next] >= self.need[self.next]:
            self._launch(self.next)
            self.next += 1

    # ------------------------------------------------------------------------ launching
    def _fill(self, i: int) -> None:
        """Bucket ``i`` is launched with gradients that did not arrive through the hook this
        step (no gradient: zeros; accumulated under no_sync, or set by hand: copied in)."""
        slots = self.slots[i]
        if slots.per_step and slots.flat is None:
            slots.make_flat()
        dst, src, zeros = [], [], []
        for j, p in enumerate(slots.params):
            g = p.grad
            if slots.views is not None and g is slots.views[j]:
                continue
            if slots.per_step and j in slots.adopted:
                continue
            slot = slots.views[j] if slots.views is not None else slots.slot(j)
            if g is None:
                zeros.append(slot)
            else:
                dst.append(slot)
                src.append(g)
        with torch.no_grad():
            if dst:
                torch._foreach_copy_(dst, src)  # one call for the bucket
            if zeros:
                torch._foreach_zero_(zeros)
                self.zeroed.add(i)
        for j, p in enumerate(slots.params):
            if p.grad is not None and (slots.views is None or p.grad is not slots.views[j]):
                p.grad = None if slots.views is None else slots.views[j]

    def _launch(self, i: int) -> None:
        bucket, backend, slots, mode = self.buckets[i], current_backend(), self.slots[i], self.modes[i]
        if self.ready[i] < self.need[i] or (slots.per_step and slots.flat is None):
            self._fill(i)
        flat = slots.flat
        for axis in bucket.axes:  # other axes first, in turn (rare: norms under split activations)
            if axis not in self.folded[i]:
                backend.all_reduce_async(flat, self.mesh.group(axis, self.rank), self.rank).wait()
        work = None
        if mode in ("all_reduce", "reduce_scatter"):
            wire = flat if slots.wire is None else slots.wire.copy_(flat)
            launch = backend.reduce_scatter_async if mode == "reduce_scatter" else backend.all_reduce_async
            work = launch(wire, self.groups[i], self.rank)
        if slots.per_step:  # ZeRO-2: the work holds the buffer now
            slots.flat = None
            slots.adopted = set()
        self.pending.append((i, flat, work))

    def _finish(self) -> None:
        while self.next < len(self.buckets):  # some gradients were None this step: zeros stand in
            self._launch(self.next)
            self.next += 1
        for i, flat, work in self.pending:
            slots, mode = self.slots[i], self.modes[i]
            result = work.wait() if work is not None else flat
            if mode == "reduce_scatter":
                self.shards.set_grad(
                    i, result if result.dtype == self.buckets[i].dtype else result.to(self.buckets[i].dtype)
                )
                continue
            if result is not flat:  # the wire buffer (reduce_dtype), or a backend that returns a new tensor
                flat.copy_(result[: flat.numel()])
            if mode == "local":  # local SGD: this rank's own gradient (its part times dp)
                flat.mul_(len(self.groups[i]))
            if i in self.zeroed:  # no gradient here this step: the sum is its gradient now
                for p, view in zip(slots.params, slots.views):
                    if p.grad is None and p.requires_grad:  # frozen since the buckets were made: None
                        p.grad = view
            self.held.add(i)
            if self.shards is not None and mode == "all_reduce":
                # this rank's slice, a view of the bucket the module's .grad are views of too
                self.shards.set_grad(i, self.shards.own_slice(i, flat), accumulate=False)
        arrived = self.arrived
        self._reset()
        if arrived is not None:
            self._rebuild(arrived)
        if self.shards is not None:  # a plain optimizer would step whole parameters on partial gradients
            self.shards.check_stepped()

    # ---------------------------------------------------------------------- rebuilding
    def _rebuild(self, arrived: list[str]) -> None:
        """The buckets again, from the order the first synced backward's gradients arrived in
        (once, as DDP): the gradients move into the new buffers."""
        self.arrived = None
        if not all(self.params[n].requires_grad for n in self.where):
            return  # frozen since: make_buckets would leave it out, the buckets stay as they are
        arrived = list(dict.fromkeys(arrived))  # each once, where it first arrived
        seen = set(arrived)  # the ones that got no gradient follow in the first buckets' order
        order = arrived + [n for b in self.buckets for n in b.names if n not in seen]
        buckets = make_buckets(self.params, self.sync_axes, *self.limits[:2], order, self.limits[2])
        if [b.names for b in buckets] == [b.names for b in self.buckets]:
            return
        old = {name: (self.params[name].grad, self.where[name][2]) for name in self.where}
        self.buckets = buckets
        self._build()
        self._reset()
        with torch.no_grad():
            for name, (grad, view) in old.items():
                if grad is not None and grad is view:
                    new = self.where[name][2]
                    new.copy_(grad)
                    self.params[name].grad = new
        self.held = set(range(len(self.buckets)))
