"""Collectives as torch custom ops with their gradients, over a swappable backend.

Each op names its mesh axis, its group (the global ranks, in axis order) and the calling
rank (an emitted graph passes the group and rank it reads from its module's attributes:
``autopar.all_reduce(x, 'tp', autopar_group_1, autopar_rank, 'sum')``), so the simulator
(all ranks in one process) knows who is calling. Gradients follow the placements
(docs/architecture.md, "The gradient contract"): the gradient of a replicated tensor is
whole on every rank, of a partial tensor whole too, of a shard the matching shard.

Backends: ``DistBackend`` (torch.distributed, gloo or NCCL) and ``simulate.SimBackend``.

Example:
    >>> with use_backend(my_backend):
    ...     y = torch.ops.autopar.all_reduce(x, "tp", [0, 1], 0, "sum")
"""
from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()
_GLOBAL: list = []  # the process-wide backend stack (the simulator's threads share it)
STATS_SINKS: list = []  # open ap.comm_stats() blocks: backends started inside report to the last


def current_backend():
    if not _GLOBAL:
        raise RuntimeError("No autopar collective backend is active: run a rank's module through "
                           "plan.simulate(...), or build it with ap.parallelize(...) in a torch.distributed job.")
    return _GLOBAL[-1]


@contextlib.contextmanager
def use_backend(backend):
    _GLOBAL.append(backend)
    attach = STATS_SINKS and getattr(backend, "stats", None) is None
    if attach:
        backend.stats = STATS_SINKS[-1]
    try:
        yield backend
    finally:
        _GLOBAL.remove(backend)
        if attach:
            backend.stats = None


def install_backend(backend) -> None:
    """Make ``backend`` the process-wide default (used by ap.parallelize for real runs).

    It replaces an earlier default of the same kind (a second ap.parallelize in one process)."""
    _GLOBAL[:] = [b for b in _GLOBAL if type(b) is not type(backend)]
    _GLOBAL.insert(0, backend)


def _pos(group, rank) -> int:
    return list(group).index(rank)


# ------------------------------------------------------------------------- op definitions
# Why not torch.library.custom_op: its Python layers (a generated autograd.Function, default
# filling, a dynamo-disable wrapper, a second dispatch to the kernel) cost ~5x a plain
# autograd.Function per call, which at small hidden sizes was most of autopar's per-step
# overhead over hand-written Megatron. The ops are the same torch ops (same schemas, fake
# kernels, in the graph, traced by export/make_fx, compiled), defined with the lower-level
# torch.library.Library: an Autograd kernel calls a plain autograd.Function whose forward,
# in plain eager mode (a real torch.Tensor, no dispatch mode active), calls the backend
# directly; under tracing (fake tensors, proxy/dispatch modes) it redispatches to the op
# below autograd so that tracers record the op itself.
_LIB = torch.library.Library("autopar", "DEF")  # noqa: TOR901 - see above
ops = torch.ops.autopar


def _fast(x) -> bool:
    """Plain eager execution on a real tensor: call the kernel directly, no tracer needs to
    see the op (no dispatch mode such as fake tensors or make_fx, no functionalization or
    functorch wrapper, which are plain ``torch.Tensor`` objects on the Python side)."""
    return (type(x) is torch.Tensor and torch._C._len_torch_dispatch_stack() == 0
            and not torch._is_functional_tensor(x) and not _functorch_wrapped(x))


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def plain_eager() -> bool:
    """Whether the emitted program runs in plain eager mode (the value of its ``autopar_eager``
    node, passed to the ops' ``owned`` / ``alias`` arguments).

    Why here and not inside the ops: code that torch.compile produced calls the ops with real
    tensors and no mode active, exactly like eager code, so an op cannot tell the two apart at
    run time. The emitted forward asks once, in Python, where Dynamo sees the question: it
    evaluates ``torch.compiler.is_compiling()`` as True while tracing, so compiled graphs hold
    ``owned=False, alias=False`` and every op there is functional, as its schema says.
    """
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


def _define(name: str, schema: str, kernel, fake, backward, saved: tuple, eager=None) -> None:
    """Define ``autopar::name`` with ``kernel`` (real tensors), ``fake`` (shapes only) and
    ``backward(ctx, grad) -> grads`` reading the ``saved`` argument names from ctx.

    ``eager`` (default: ``kernel``) is what the autograd forward runs in plain eager mode. It
    may work in place or return its input (an autograd.Function output, as in Megatron's f)
    only where the op's ``owned`` / ``alias`` argument says so, and the emitted program sets
    that argument from ``plain_eager()``: False in compiled code, where the op must then be
    exactly what its schema says (a fresh output, no mutation).
    """
    _LIB.define(name + schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"autopar::{name}", fake, lib=_LIB)
    op = getattr(ops, name).default
    run_eager = eager or kernel

    def forward(ctx, *args):
        for key, value in zip(saved, args[1:]):
            setattr(ctx, key, value)
        if _fast(args[0]):
            return run_eager(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    fn = type(f"{name}_autograd", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    _LIB.impl(name, fn.apply, "Autograd")


def _call(name: str, *args):
    """Run op ``name`` from a backward: the kernel directly when nothing needs to see or
    differentiate it (no double backward), the op otherwise."""
    x = args[0]
    if _fast(x) and not (torch.is_grad_enabled() and x.requires_grad):
        return _KERNELS[name](*args)
    return getattr(ops, name).default(*args)


# ------------------------------------------------------------------------------- kernels
def all_reduce(x: torch.Tensor, axis: str, group: list[int], rank: int, op: str, owned: bool = False) -> torch.Tensor:
    """P -> R: sum (or average) over the group.

    ``owned``: the emitter saw that nothing else reads ``x`` (the fresh output of a matmul-like
    op whose backward does not keep it, with this collective as its only use) and the program
    runs in plain eager mode (``plain_eager()``). The eager path may then reduce it in place,
    as hand-written Megatron does, instead of copying it first. Compiled code passes False,
    and traced execution never takes the eager path (the op stays functional).
    """
    return current_backend().all_reduce(x, tuple(group), rank, op)


def _all_reduce_eager(x, axis, group, rank, op, owned=False):
    backend = current_backend()
    if owned and hasattr(backend, "all_reduce_"):
        return backend.all_reduce_(x, tuple(group), rank, op)
    return backend.all_reduce(x, tuple(group), rank, op)


def all_gather(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """S(dim) -> R: concatenate the group's pieces along ``dim``."""
    return current_backend().all_gather(x, dim, tuple(group), rank)


def reduce_scatter(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int, op: str) -> torch.Tensor:
    """P -> S(dim): reduce over the group, keep this rank's chunk of ``dim``."""
    return current_backend().reduce_scatter(x, dim, tuple(group), rank, op)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, axis: str, group: list[int],
               rank: int) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim): regroup the pieces."""
    return current_backend().all_to_all(x, src_dim, dst_dim, tuple(group), rank)


def shard(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """R -> S(dim): keep this rank's chunk, locally (backward all-gathers)."""
    n = len(group)
    size = x.shape[dim] // n
    return x.narrow(dim, _pos(group, rank) * size, size).clone()


def to_partial(x: torch.Tensor, axis: str, group: list[int], rank: int, op: str) -> torch.Tensor:
    """R -> P: the first rank of the group keeps the value, the others hold zeros (avg: all keep it)."""
    if op == "avg" or _pos(group, rank) == 0:
        return x.clone()
    return torch.zeros_like(x)


def grad_all_reduce(x: torch.Tensor, axis: str, group: list[int], rank: int, alias: bool = False) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's "f").

    Placed where a replicated tensor feeds computation that is split on ``axis``: each rank's
    gradient is then only its part's contribution, and the sum over the group is the whole.
    """
    return x.clone()


def scale_grad(x: torch.Tensor, axis: str, factor: float, alias: bool = False) -> torch.Tensor:
    """Identity forward, gradient times ``factor`` backward.

    On outputs left split over the data-parallel axis: each rank's loss is then the mean over
    its own slice of the batch, and averaging the gradients over the axis (as DDP does) makes
    them the serial model's.
    """
    return x.clone()


def _grad_all_reduce_eager(x, axis, group, rank, alias=False):
    """The eager path of an identity op: its input itself where the program allowed it
    (``alias``, from ``plain_eager()``), else a fresh copy as the schema promises."""
    return x if alias else x.clone()


def _scale_grad_eager(x, axis, factor, alias=False):
    return x if alias else x.clone()


_KERNELS = {f.__name__: f for f in (all_reduce, all_gather, reduce_scatter, all_to_all, shard, to_partial,
                                    grad_all_reduce, scale_grad)}


# ----------------------------------------------------------------------------- fake impls
def _same(x, *args):
    return torch.empty_like(x)


def _gather_fake(x, dim, axis, group, rank):
    shape = list(x.shape)
    shape[dim] *= len(group)
    return x.new_empty(shape)


def _split_fake(x, dim, axis, group, rank, op=None):
    shape = list(x.shape)
    shape[dim] //= len(group)
    return x.new_empty(shape)


def _all_to_all_fake(x, src_dim, dst_dim, axis, group, rank):
    shape = list(x.shape)
    shape[src_dim] *= len(group)
    shape[dst_dim] //= len(group)
    return x.new_empty(shape)


# --------------------------------------------------------------------------------- autograd
def _all_reduce_bwd(ctx, g):
    if ctx.op == "avg":
        g = g / len(ctx.group)
    return g, None, None, None, None, None


def _all_gather_bwd(ctx, g):
    return _call("shard", g, ctx.dim, ctx.axis, ctx.group, ctx.rank), None, None, None, None


def _reduce_scatter_bwd(ctx, g):
    full = _call("all_gather", g.contiguous(), ctx.dim, ctx.axis, ctx.group, ctx.rank)
    if ctx.op == "avg":
        full = full / len(ctx.group)
    return full, None, None, None, None, None


def _all_to_all_bwd(ctx, g):
    back = _call("all_to_all", g.contiguous(), ctx.dst_dim, ctx.src_dim, ctx.axis, ctx.group, ctx.rank)
    return back, None, None, None, None, None


def _shard_bwd(ctx, g):
    return _call("all_gather", g.contiguous(), ctx.dim, ctx.axis, ctx.group, ctx.rank), None, None, None, None


def _to_partial_bwd(ctx, g):
    # The pieces of P(avg) carry 1/n of the whole gradient each (all_reduce(avg)'s backward), and
    # every rank's piece is this replicated value: its whole gradient is n times a piece's.
    if ctx.op == "avg":
        g = g * len(ctx.group)
    return g, None, None, None, None


def _grad_all_reduce_bwd(ctx, g):
    return _call("all_reduce", g.contiguous(), ctx.axis, ctx.group, ctx.rank, "sum"), None, None, None, None


def _scale_grad_bwd(ctx, g):
    return g * ctx.factor, None, None, None


_G = "str axis, int[] group, int rank"
_define("all_reduce", f"(Tensor x, {_G}, str op, bool owned=False) -> Tensor", all_reduce, _same,
        _all_reduce_bwd, ("axis", "group", "rank", "op"), eager=_all_reduce_eager)
_define("all_gather", f"(Tensor x, int dim, {_G}) -> Tensor", all_gather, _gather_fake, _all_gather_bwd,
        ("dim", "axis", "group", "rank"))
_define("reduce_scatter", f"(Tensor x, int dim, {_G}, str op) -> Tensor", reduce_scatter, _split_fake,
        _reduce_scatter_bwd, ("dim", "axis", "group", "rank", "op"))
_define("all_to_all", f"(Tensor x, int src_dim, int dst_dim, {_G}) -> Tensor", all_to_all, _all_to_all_fake,
        _all_to_all_bwd, ("src_dim", "dst_dim", "axis", "group", "rank"))
_define("shard", f"(Tensor x, int dim, {_G}) -> Tensor", shard, _split_fake, _shard_bwd,
        ("dim", "axis", "group", "rank"))
_define("to_partial", f"(Tensor x, {_G}, str op) -> Tensor", to_partial, _same, _to_partial_bwd,
        ("axis", "group", "rank", "op"))
_define("grad_all_reduce", f"(Tensor x, {_G}, bool alias=False) -> Tensor", grad_all_reduce, _same,
        _grad_all_reduce_bwd, ("axis", "group", "rank"), eager=_grad_all_reduce_eager)
_define("scale_grad", "(Tensor x, str axis, float factor, bool alias=False) -> Tensor", scale_grad, _same,
        _scale_grad_bwd, ("axis", "factor"), eager=_scale_grad_eager)


# ---------------------------------------------------------------------------- local math
def chunk_of(full: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    size = full.shape[dim] // n
    return full.narrow(dim, index * size, size)


def all_to_all_local(pieces: list[torch.Tensor], src_dim: int, dst_dim: int, index: int) -> torch.Tensor:
    """What rank ``index`` of a group gets from all_to_all, given every rank's piece."""
    n = len(pieces)
    return torch.cat([chunk_of(p, dst_dim, n, index) for p in pieces], dim=src_dim)


# ------------------------------------------------------------------------------ real backend
class DistBackend:
    """Collectives over torch.distributed process groups (gloo on CPU, NCCL on GPU).

    ``groups`` maps each group's tuple of global ranks to its ProcessGroup; ap.parallelize makes
    them all, on every rank in the same order, before the first step.
    """

    def __init__(self, groups: dict, rank: int, timeout: float | None = None,
                 groups_timeout: float | None = None):
        self.groups = groups
        self.rank = rank
        self.stats = None
        self.timeout = timeout  # seconds a collective may wait before failing (None: the group's)
        self.groups_timeout = groups_timeout  # the timeout the process groups were made with

    def _run(self, kind, group, call):
        """Run a blocking collective ``call(async_op)``; a failure or a timeout raises
        CollectiveError naming the rank that failed (see failures.py), never hangs past timeout.

        Why blocking: on gloo, async_op=True plus work.wait() costs about 0.3 ms more per
        collective than the blocking call, and a wait with a timeout another 0.4 ms, which is
        most of a small model's step. Where the groups were made with this timeout (ap.parallelize
        does), the blocking call is bounded by it; otherwise (timeout changed since) the
        collective waits with the timeout explicitly.
        """
        if self.timeout is not None and self.timeout != self.groups_timeout:
            return self._wait(kind, group, lambda: call(True))
        from autopar.runtime.failures import explain
        try:
            call(False)
        except Exception as e:  # noqa: BLE001 - re-raised with the failed rank named
            raise explain(kind, group, self.rank, self.timeout, e) from e

    def _wait(self, kind, group, start):
        """Run ``start()`` (an async collective) and wait for it; a failure or a timeout raises
        CollectiveError naming the rank that failed (see failures.py), never hangs past timeout."""
        import datetime
        from autopar.runtime.failures import explain
        try:
            work = start()
            done = work.wait(datetime.timedelta(seconds=self.timeout)) if self.timeout else work.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with the failed rank named
            raise explain(kind, group, self.rank, self.timeout, e) from e
        if done is False:
            raise explain(kind, group, self.rank, self.timeout, TimeoutError("timed out"))

    def _pg(self, group, rank):
        if rank != self.rank:
            raise RuntimeError(f"autopar: a module built for rank {rank} is running on rank {self.rank}; "
                               "build it with plan.module(dist.get_rank()) or ap.parallelize.")
        return self.groups[group]

    def _note(self, kind, group, t):
        if self.stats is not None:
            self.stats.record(kind, group, t)

    def all_reduce(self, x, group, rank, op, kind="all_reduce"):
        import torch.distributed as dist
        y = x.contiguous().clone()
        self._note(kind, group, y)
        pg = self._pg(group, rank)
        self._run(kind, group, lambda a: dist.all_reduce(y, group=pg, async_op=a))
        return y / len(group) if op == "avg" else y

    def all_reduce_(self, x, group, rank, op):
        """In place, for inputs nothing else reads (see the ``owned`` hint of autopar::all_reduce)."""
        import torch.distributed as dist
        if not x.is_contiguous():
            return self.all_reduce(x, group, rank, op)
        self._note("all_reduce", group, x)
        pg = self._pg(group, rank)
        self._run("all_reduce", group, lambda a: dist.all_reduce(x, group=pg, async_op=a))
        return x.div_(len(group)) if op == "avg" else x

    def all_gather(self, x, dim, group, rank, kind="all_gather"):
        import torch.distributed as dist
        x = x.contiguous()
        self._note(kind, group, x)
        out = [torch.empty_like(x) for _ in group]
        pg = self._pg(group, rank)
        self._run(kind, group, lambda a: dist.all_gather(out, x, group=pg, async_op=a))
        return torch.cat(out, dim=dim)

    def reduce_scatter(self, x, dim, group, rank, op):
        # gloo has no reduce_scatter: all-reduce, then keep this rank's chunk (noted as what it stands for).
        full = self.all_reduce(x, group, rank, op, kind="reduce_scatter")
        return chunk_of(full, dim, len(group), _pos(group, rank)).contiguous()

    def all_to_all(self, x, src_dim, dst_dim, group, rank):
        pieces = self.all_gather(x, 0, group, rank, kind="all_to_all").chunk(len(group), dim=0) if x.dim() else None
        return all_to_all_local(list(pieces), src_dim, dst_dim, _pos(group, rank)).contiguous()

    def all_reduce_async(self, flat, group, rank):
        import torch.distributed as dist
        self._note("all_reduce", group, flat)
        pg = self._pg(group, rank)
        try:
            work = dist.all_reduce(flat, group=pg, async_op=True)
        except Exception as e:  # noqa: BLE001 - named like the others
            from autopar.runtime.failures import explain
            raise explain("all_reduce", group, rank, self.timeout, e) from e
        return _Work(work, flat, lambda: self._wait("all_reduce", group, lambda: work))

    def broadcast(self, x, group, rank):
        import torch.distributed as dist
        self._note("broadcast", group, x)
        pg = self._pg(group, rank)
        self._run("broadcast", group, lambda a: dist.broadcast(x, src=group[0], group=pg, async_op=a))

    # -- used by the data-parallel gradient sync and ZeRO ------------------------------------
    def reduce_scatter_async(self, flat, group, rank):
        """Sum ``flat`` (numel divisible by the group size) over the group; wait() gives this
        rank's contiguous chunk. Falls back to all-reduce + slice where the process group has
        no reduce-scatter (older gloo)."""
        import torch.distributed as dist
        n, pos = len(group), _pos(group, rank)
        out = flat.new_empty(flat.numel() // n)
        self._note("reduce_scatter", group, flat)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            return _Work(rs(out, flat, group=self._pg(group, rank), async_op=True), out)
        except (RuntimeError, NotImplementedError):  # no reduce-scatter in this process group
            work = dist.all_reduce(flat, group=self._pg(group, rank), async_op=True)
            return _Work(work, flat.view(n, -1)[pos])

    def all_gather_async(self, out, chunk, group, rank):
        """Concatenate every rank's ``chunk`` into ``out`` (numel = group size * chunk numel)."""
        import torch.distributed as dist
        self._note("all_gather", group, chunk)
        work = dist.all_gather_into_tensor(out, chunk, group=self._pg(group, rank), async_op=True)
        return _Work(work, out)


class _Work:
    def __init__(self, work, result, wait=None):
        self.work, self.result, self._wait = work, result, wait

    def wait(self):
        if self._wait is not None:
            self._wait()
        else:
            self.work.wait()
        return self.result
