"""Gradient sync: sum the gradients that arrive in parts (data parallel, and norms under
split activations) over their axes, fused into buckets and overlapped with backward.

Buckets are formed once, the same way on every rank: parameters in the order backward
finishes their gradients (the reverse of their first use in the forward graph), grouped by
dtype and by the axes to reduce over, closed when they reach ``bucket_bytes`` or
``bucket_max_params``. A bucket's collective is launched as soon as its last gradient has
been accumulated, strictly in bucket order (bucket i+1 never goes before bucket i, so every
rank issues the same sequence even if some gradient is late or missing); at the end of
backward every bucket is waited for once and the sums written back into ``.grad``. Frozen
parameters are left out; a parameter with no gradient in a step counts as zeros, so every
rank launches the same collectives and none waits forever. A parameter frozen after the
buckets were made (``requires_grad_(False)`` on the rank module, as fine-tuning code does
after set-up) still has its zeros in its bucket, but gets no ``.grad``: an optimizer with
weight decay must not move it.

On the data-parallel axis the ap.DataParallel options apply: ``reduce_dtype`` (cast for the
collective, cast back after), ``zero=1`` (all-reduce, then the ZeroOptimizer steps this
rank's slice), ``zero=2`` (reduce-scatter; each parameter's ``.grad`` is freed as soon as
its bucket is launched, and only this rank's reduced slice is kept), ``local_sgd_every``
(no collective: each rank keeps its own gradient). Other axes get a plain all-reduce.

Example:
    >>> sync = GradSync(module, {"fc.weight": (0,)}, mesh, rank)   # attach hooks
    >>> loss.backward()      # gradients of fc.weight are now summed over axis 0
    >>> with sync.no_sync(): loss2.backward()   # accumulate locally, sync on the next backward
"""

from __future__ import annotations

import contextlib

import torch

from autopar.runtime.backend import current_backend
from autopar.errors import DataParallelError
from autopar.parallel.grad_buckets import DEFAULT_BUCKET_MB, Bucket, make_buckets
from autopar.parallel.zero import ZeroShards


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
        self.params = dict(module.named_parameters())
        self.buckets = make_buckets(self.params, sync_axes, bucket_bytes, bucket_max_params, order, first)
        self.bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b.names}
        self.enabled = True
        self.zero = None  # ZeroShards, for zero=1|2 (set below)
        self.zero_optimizer = None  # the ap.ZeroOptimizer stepping the shards, once made
        if dp is not None and dp.zero in (1, 2):  # zero=3: the gathers reduce (parallel/fsdp.py)
            self.zero = ZeroShards(self, [i for i, b in enumerate(self.buckets) if self.on_dp(b)])
        self._reset()
        self.held: set[int] = set()  # buckets whose .grad hold synced sums (no zero_grad since)
        for name in self.bucket_of:
            self.params[name].register_post_accumulate_grad_hook(self._make_hook(name))
        module.register_forward_pre_hook(self._rescale_held)

    # -------------------------------------------------------------------------- queries
    def on_dp(self, bucket: Bucket) -> bool:
        return self.dp_axis is not None and self.dp_axis in bucket.axes

    def dp_group(self) -> tuple[int, ...]:
        return self.mesh.group(self.dp_axis, self.rank)

    def _mode(self, bucket: Bucket) -> str:
        """How the bucket is reduced on the dp axis: none | all_reduce | reduce_scatter | local."""
        if not self.on_dp(bucket):
            return "none"
        if self.dp is not None and self.dp.local_sgd_every is not None:
            return "local"
        return "reduce_scatter" if self.dp is not None and self.dp.zero == 2 else "all_reduce"

    def factor(self, bucket: Bucket) -> int:
        """How many rank-parts the bucket's sync adds up (the product of its groups' sizes)."""
        out = 1
        for axis in bucket.axes:
            out *= self.mesh.shape[axis]
        return out

    # ---------------------------------------------------------------------------- hooks
    def _rescale_held(self, module, args) -> None:
        """Gradients kept from a synced backward (no zero_grad) would be summed again with the
        new parts: divide them by the number of parts first, so the next sync adds them once."""
        if not self.held or not torch.is_grad_enabled():
            return
        with torch.no_grad():
            for i in self.held:
                for n in self.buckets[i].names:
                    if self.params[n].grad is not None:
                        self.params[n].grad.div_(self.factor(self.buckets[i]))
        self.held.clear()

    def _reset(self):
        self.ready = [0] * len(self.buckets)
        self.next = 0  # the next bucket to launch: buckets go strictly in order
        self.pending: dict[int, tuple] = {}
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
        i = self.bucket_of[name]

        def hook(param):
            if not self.enabled:
                return
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.ready[i] += 1
            while self.next < len(self.buckets) and self.ready[self.next] >= len(self.buckets[self.next].names):
                self._launch(self.next)
                self.next += 1

        return hook

    # ------------------------------------------------------------------------ launching
    def _flat(self, bucket: Bucket, pad_to: int) -> torch.Tensor:
        parts = []
        for n in bucket.names:
            p = self.params[n]
            parts.append(p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()))
        if pad_to > bucket.numel:
            parts.append(parts[0].new_zeros(pad_to - bucket.numel))
        return torch.cat(parts)

    def _launch(self, i: int) -> None:
        bucket, backend = self.buckets[i], current_backend()
        mode = self._mode(bucket)
        n = len(self.dp_group()) if mode != "none" else 1
        flat = self._flat(bucket, -(-bucket.numel // n) * n if mode == "reduce_scatter" else 0)
        for axis in bucket.axes:  # other axes first, in turn (rare: norms under split activations)
            if axis != self.dp_axis:
                backend.all_reduce_async(flat, self.mesh.group(axis, self.rank), self.rank).wait()
        work, wire = None, flat
        if mode in ("all_reduce", "reduce_scatter"):
            if self.dp.reduce_dtype is not None and self.dp.reduce_dtype != flat.dtype:
                wire = flat.to(self.dp.reduce_dtype)
            launch = backend.reduce_scatter_async if mode == "reduce_scatter" else backend.all_reduce_async
            work = launch(wire, self.dp_group(), self.rank)
        if mode == "reduce_scatter":
            for name in bucket.names:  # ZeRO-2: the flat holds the gradients now; free them
                self.params[name].grad = None
        self.pending[i] = (flat, work)

    def _finish(self) -> None:
        while self.next < len(self.buckets):  # some gradients were None this step: zeros stand in
            self._launch(self.next)
            self.next += 1
        for i, (flat, work) in sorted(self.pending.items()):
            bucket = self.buckets[i]
            result = work.wait() if work is not None else flat
            if result.dtype != bucket.dtype:
                result = result.to(bucket.dtype)
            mode = self._mode(bucket)
            if mode == "local":  # local SGD: this rank's own gradient (its part times dp)
                result = result.mul_(len(self.dp_group()))
            if mode == "reduce_scatter":
                self.zero.set_grad(i, result)
                continue
            self._write_back(bucket, result)
            self.held.add(i)
            if self.zero is not None and mode == "all_reduce":
                # a copy of this rank's slice: a view would keep the whole reduced bucket alive
                # next to the .grad it was written back into, until zero_grad (ZeRO-1's old leak)
                self.zero.set_grad(i, self.zero.own_slice(i, result).clone(), accumulate=False)
        self._reset()
        if self.zero is not None and self.zero_optimizer is None:
            raise DataParallelError(
                f"DataParallel(zero={self.dp.zero}): gradients are sharded over the ranks, so a plain optimizer "
                "would step on partial or missing gradients. Make the optimizer with "
                "ap.ZeroOptimizer(module, torch.optim.AdamW, lr=...) (or plan.zero_optimizer(...)) before backward."
            )

    def _write_back(self, bucket: Bucket, flat: torch.Tensor) -> None:
        params = [self.params[n] for n in bucket.names]
        pieces = flat[: bucket.numel].split([p.numel() for p in params])  # views, one C++ call
        have = [
            (p.grad.view(-1), piece)
            for p, piece in zip(params, pieces)
            if p.grad is not None and p.grad.is_contiguous()
        ]
        if have:  # one fused copy for the bucket (per-parameter copies cost ~10 us each in Python)
            torch._foreach_copy_([g for g, _ in have], [piece for _, piece in have])
        for p, piece in zip(params, pieces):
            if p.grad is None:
                if p.requires_grad:  # frozen since the buckets were made: left as None
                    p.grad = piece.view_as(p).clone()
            elif not p.grad.is_contiguous():
                p.grad.copy_(piece.view_as(p))
