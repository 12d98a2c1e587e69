"""The run-time half of fully sharded data parallel (parallel/data_parallel/fsdp.py plans the buckets and
writes the gathers into the program): each rank module's flat chunks, the gather op with its
reduce-scatter backward, prefetching, resharding after forward and no_sync.

Example:
    >>> attach(plan, module, rank)               # module.autopar_fsdp is its FSDPRuntime
    >>> params = fsdp_gather(module.autopar_fsdp, 3, *pieces)   # what the program calls
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch

from autopar.runtime.eager import eager
from autopar.parallel.data_parallel.fsdp_layout import (
    RUNTIME_ATTR,
    FlatBucket,
    _numel,
    groups,
    rank_buckets,
    shard_axes,
)
from autopar.parallel.param_names import canonical_names
from autopar.runtime.backend import current_backend


@eager
def fsdp_gather(runtime, k: int, *pieces):
    """Bucket ``k``'s parameters, gathered (see the module docstring); an op of the program.

    Under torch.compile it runs eagerly between compiled pieces (a graph break per bucket, as
    FSDP2's hooks): it starts and waits for asynchronous collectives and keeps run-time state
    (prefetches, the buckets to gather again), which a traced graph cannot hold. Traced, it
    was retraced for every bucket until Dynamo's recompile limit."""
    out = _Gather.apply(runtime, k, *pieces)
    for t in out:  # parameters, not activations: a checkpoint that offloads keeps them where they are
        t.autopar_parameter = True
    return out


# Run once per forward, never again in a recompute: its prefetches and the buckets it regathers are
# run-time state (an activation checkpoint region leaves it before the region: parallel/activation_checkpoint/regions.py).
# The recompute gathers the block again all the same, through the saved-tensor hooks below: the
# checkpoint saves its inputs, the gathered parameters among them, as (bucket, view).
fsdp_gather.autopar_not_recomputed = True


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runtime, k, *pieces):
        ctx.runtime, ctx.k, ctx.n = runtime, k, len(pieces)
        out = tuple(runtime.gathered(k))
        ctx.mark_non_differentiable(*out[len(pieces) :])  # a wire's extra outputs (fp8 data, scales)
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.runtime.reduce(ctx.k, grads[: ctx.n]))


# ------------------------------------------------------------------------------ runtime
@dataclass(frozen=True)
class _Packed:
    """A saved tensor that lived in bucket k's gathered flat: gathered again in backward."""

    k: int
    offset: int
    size: tuple
    stride: tuple


class _Done:
    def __init__(self, out):
        self.out = out

    def wait(self):
        return self.out


class FSDPRuntime:
    """One rank's flat chunks, gathers in flight, and the saved-tensor hooks of its module."""

    def __init__(self, plan, module: torch.nn.Module, rank: int):
        dp = plan.data_parallel
        self.rank, self.buckets = rank, rank_buckets(plan, rank)
        self.shard, self.replica = groups(plan, rank)
        self.pos = self.shard.index(rank)
        self.param_dtype, self.reduce_dtype, self.prefetch = dp.param_dtype, dp.reduce_dtype, dp.prefetch
        self.reshard = dp.reshard_after_forward
        sync = plan.grad_sync_axes
        canon = canonical_names(plan)
        # a gradient whole on a shard axis (not summed over it: every rank there holds all of it) is
        # divided by the axis' size, so that the group's sum counts it once
        axes, shape = shard_axes(plan), plan.mesh.shape
        self.whole = [
            [math.prod(shape[a] for a in axes if a not in sync.get(canon.get(n, n), ())) for n in b.names]
            for b in self.buckets
        ]
        # the buckets this module holds, in forward order (a pipeline stage holds its own only)
        self.aliases = {n: [m for m, c in canon.items() if c == n] for b in self.buckets for n in b.names}
        self.held = [k for k, b in enumerate(self.buckets) if all(self._param(module, n) is not None for n in b.names)]
        self.flats = {k: self._flatten(module, self.buckets[k]) for k in self.held}
        # the run-time half of each wire form a technique gathers buckets in (Technique.gather_wire)
        self.wires = {w: w.bind(plan, self) for w in {b.wire for b in self.buckets if b.wire is not None}}
        self.sync_enabled = True
        self.acc: dict[int, torch.Tensor] = {}
        # without resharding after forward, a bucket gathered for a forward with gradients stays
        # gathered until its gradient is reduced: the forwards of later micro-batches (a pipeline's,
        # no_sync's accumulation) read the same copy (bucket -> (its pieces' version, the gathered
        # flat): an optimizer step in between changes the version, and the bucket is gathered again).
        # Each forward gathered its own before: a 405B stage-0 rank of 1F1B held 8 copies of its
        # stage's blocks (92 GiB in a dry run, 11.6 GiB each) where FSDP2 under torchtitan holds one.
        self.kept: dict[int, tuple[int, torch.Tensor]] = {}
        self._keep = False  # this forward's gathers are kept (set at its start: the gather op runs without grad)
        self._clear()
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward, always_call=True)

    def _param(self, module, name: str):
        """The module's parameter stored under ``name`` or a name tied to it (None if absent)."""
        for alias in self.aliases.get(name, [name]):
            try:
                return module.get_parameter(alias)
            except AttributeError:
                continue
        return None

    def _flatten(self, module, b: FlatBucket) -> torch.Tensor:
        """The bucket's chunk as one buffer; the module's pieces become views of it (on the meta
        device for a meta-device model: shapes only, no data to copy, no host memory taken)."""
        params = [p for p in (self._param(module, n) for n in b.names) if p is not None]
        meta = any(p.is_meta for p in params)
        # on the pieces' device: made on the default device (the CPU), a CUDA module's pieces
        # would have become CPU views
        flat = torch.zeros(b.chunk, dtype=b.dtype, device=params[0].device if params else None)
        with torch.no_grad():
            for i, name in enumerate(b.names):
                lo, hi = b.piece(i, self.pos)
                p = self._param(module, name)
                if hi > lo and not meta:
                    flat[lo:hi].copy_(p.detach().reshape(-1))
                p.data = flat[lo:hi]
        return flat

    def _clear(self):
        for wire in getattr(self, "wires", {}).values():  # a new forward: the parameters may have been stepped
            wire.reset()
        self.pending: dict[int, object] = {}
        self.regather: dict[int, torch.Tensor] = {}
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.saved_order: list[int] = []
        self._hooks = None

    # ------------------------------------------------------------------- gathering
    def _start(self, k: int) -> None:
        src, b = self.flats[k], self.buckets[k]
        src = src.to(b.compute_dtype(self.param_dtype))  # kept-in-fp32 buckets: as they are
        if b.wire is not None:  # the technique's form (fp8 bytes: gloo has no float8 dtype, so as uint8)
            src = self.wires[b.wire].pack(k, src).view(torch.uint8)
        out = src.new_empty(src.numel() * len(self.shard))
        if len(self.shard) == 1:
            self.pending[k] = _Done(out.copy_(src))
        else:
            self.pending[k] = current_backend().all_gather_async(out, src, self.shard, self.rank)

    def _wait(self, k: int) -> torch.Tensor:
        kept = self.kept.get(k)
        if kept is not None and kept[0] == self.flats[k]._version:
            return kept[1]
        if k not in self.pending:
            self._start(k)
        flat = self.pending.pop(k).wait()
        wire = self.buckets[k].wire
        if wire is not None:  # fp8 bytes: packed with this forward's scales, so never kept across forwards
            return flat.view(wire.dtype)
        if self._keep:
            self.kept[k] = (self.flats[k]._version, flat)
        return flat

    def _held_gathered(self, k: int) -> bool:
        kept = self.kept.get(k)
        return kept is not None and kept[0] == self.flats[k]._version

    def views(self, k: int, flat: torch.Tensor) -> list[torch.Tensor]:
        b = self.buckets[k]
        return [flat[o : o + _numel(s)].view(s) for o, s in zip(b.offsets, b.shapes)]

    def gathered(self, k: int) -> list[torch.Tensor]:
        """Bucket k gathered (waiting for its prefetch), the next buckets' gathers started."""
        flat = self._wait(k)
        i = self.held.index(k)
        for j in self.held[i + 1 : i + 1 + self.prefetch]:
            if j not in self.pending and not self._held_gathered(j):
                self._start(j)
        if self._hooks is not None:
            root = (
                flat if flat._base is None else flat._base
            )  # a wire's dtype view: its views' base is the gathered bytes
            self.live[flat.untyped_storage()._cdata] = (k, weakref.ref(root))
        wire = self.buckets[k].wire
        return self.views(k, flat) if wire is None else self.wires[wire].unpack(k, self.views(k, flat))

    def _regathered(self, k: int) -> torch.Tensor:
        """Bucket k gathered again for backward; the buckets backward needs next prefetched."""
        if k not in self.regather:
            self.regather[k] = self._wait(k)
            i = self.saved_order.index(k)
            for j in self.saved_order[max(0, i - self.prefetch) : i][::-1]:
                if j not in self.regather and j not in self.pending:
                    self._start(j)
        return self.regather[k]

    # ------------------------------------------------------------------ saved tensors
    def _pack(self, t):
        try:
            hit = self.live.get(t.untyped_storage()._cdata)  # the storage, not its address: a fake tensor has none
        except (RuntimeError, NotImplementedError):
            return t.detach()
        if hit is None or hit[1]() is None:
            # detached: a pack returning ``t`` itself makes a cycle (an op saving its own output)
            # that a retained graph (a zero-bubble pipeline's B and W) never frees
            return t.detach()
        if hit[0] not in self.saved_order:
            self.saved_order.append(hit[0])
        return _Packed(hit[0], t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def _unpack(self, x):
        if not isinstance(x, _Packed):
            return x
        return self._regathered(x.k).as_strided(x.size, x.stride, x.offset)

    @eager  # enters saved-tensor hooks for the whole forward: not traceable
    def _pre_forward(self, module, args):
        if not torch.is_grad_enabled():
            # A forward that records no graph (a checkpointed pipeline stage's first run, eval)
            # leaves the saved order and regathered buckets alone: a graph recorded earlier may
            # still await part of its backward (a zero-bubble schedule's W after another
            # micro-batch's forward: ZBV's rank 1 runs B0 F2 W0 on one stage). Prefetched gathers
            # go: they may be of parameters an optimizer step has changed since.
            self.pending, self.live = {}, {}
            self._keep = False
            return
        self._clear()
        self._keep = not self.reshard  # one gathered copy across a step's forwards (a pipeline's micro-batches)
        if self.reshard:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    @eager
    def _post_forward(self, module, args, output):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self.live.clear()

    # ---------------------------------------------------------------------- backward
    def reduce(self, k: int, grads) -> list:
        """Bucket k's gradient reduce-scattered (and all-reduced over replicas) into the pieces."""
        b = self.buckets[k]
        # the gathered block is used no more (this runs after its last use's backward): free it
        # before the gradient flat takes its place, not after (one block less at the peak)
        self.regather.pop(k, None)
        if self.sync_enabled:  # the step's last backward of this bucket: the kept copy goes too
            self.kept.pop(k, None)
        dtype = self.reduce_dtype or next((g.dtype for g in grads if g is not None), b.dtype)
        flat = torch.zeros(b.chunk * len(self.shard), dtype=dtype, device=self.flats[k].device)  # the pieces'
        for g, o, s, whole in zip(grads, b.offsets, b.shapes, self.whole[k]):
            if g is not None:
                part = flat[o : o + _numel(s)]
                part.copy_(g.reshape(-1))
                if whole > 1:  # ranks of the group hold the whole gradient: the sums below count it once
                    part.div_(whole)
        if not self.sync_enabled:  # no_sync: accumulate the unreduced gradient locally
            self.acc[k] = flat if k not in self.acc else self.acc[k].add_(flat)
            return [None] * len(b.names)
        if k in self.acc:
            flat.add_(self.acc.pop(k))
        backend = current_backend()
        mine = backend.reduce_scatter_async(flat, self.shard, self.rank).wait() if len(self.shard) > 1 else flat
        if len(self.replica) > 1:  # the async form: a gradient's sum (ap.FaultTolerant routes it via torchft)
            mine = backend.all_reduce_async(mine, self.replica, self.rank).wait()
        mine = mine.to(b.dtype)
        if mine._base is not None:  # a view of the whole bucket (all-reduce fallback): keep only ours
            mine = mine.clone()
        out = []
        for i in range(len(b.names)):
            lo, hi = b.piece(i, self.pos)
            # an empty piece gets an empty gradient: every parameter of the module has a .grad after
            # backward, as without ZeRO-3 (per-rank gradient dicts then all hold the same names)
            out.append(mine[lo:hi] if hi > lo else mine.new_zeros(0))
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients unreduced (full buckets, locally); the next backward reduces them."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True


def attach(plan, module, rank: int) -> None:
    """The rank module's runtime (zero=3), and a no_sync covering the gathers' reductions."""
    runtime = FSDPRuntime(plan, module, rank)
    setattr(module, RUNTIME_ATTR, runtime)
    grad_sync = getattr(module, "autopar_grad_sync", None)

    @contextlib.contextmanager
    def no_sync():
        with runtime.no_sync(), grad_sync.no_sync() if grad_sync is not None else contextlib.nullcontext():
            yield

    module.no_sync = no_sync
