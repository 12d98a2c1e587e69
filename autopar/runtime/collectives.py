"""Collectives as torch custom ops with their gradients, over a swappable backend.

Each op names its mesh axis, its group (the global ranks, in axis order) and the calling
rank (an emitted graph passes the group and rank it reads from its module's attributes:
``autopar.all_reduce(x, 'tp', autopar_group_1, autopar_rank, 'sum')``), so the simulator
(all ranks in one process) knows who is calling. Gradients follow the placements
(docs/architecture.md, "The gradient contract"): the gradient of a replicated tensor is
whole on every rank, of a partial tensor whole too, of a shard the matching shard.

The backends that run them are in runtime/backend.py (the protocol and the active one).
``all_gather_rs`` is all-gather forward, reduce-scatter backward: Megatron's sequence-parallel
pair (a sequence-split activation gathered into a column-parallel layer gets, from each rank,
only its own part of the gathered tensor's gradient; summing the parts and keeping this rank's
chunk is one reduce-scatter, where the plain all_gather's slice would need an all-reduce first).

Example:
    >>> with use_backend(my_backend):
    ...     y = torch.ops.autopar.all_reduce(x, "tp", [0, 1], 0, "sum")
"""

from __future__ import annotations

import contextlib

import torch

from autopar.runtime.backend import current_backend
from autopar.runtime.pieces import _pos

# ------------------------------------------------------------------------- op definitions
# Why not torch.library.custom_op: its Python layers (a generated autograd.Function, default
# filling, a dynamo-disable wrapper, a second dispatch to the kernel) cost ~5x a plain
# autograd.Function per call, which at small hidden sizes was most of autopar's per-step
# overhead over hand-written Megatron. The ops are the same torch ops (same schemas, fake
# kernels, in the graph, traced by export/make_fx, compiled), defined with the lower-level
# torch.library.Library: an Autograd kernel calls a plain autograd.Function whose forward,
# in plain eager mode (a real torch.Tensor, no dispatch mode active but observers), calls the backend
# directly; under tracing (fake tensors, proxy/dispatch modes) it redispatches to the op
# below autograd so that tracers record the op itself.
_LIB = torch.library.Library("autopar", "DEF")  # noqa: TOR901 - see above
ops = torch.ops.autopar


def _fast(x) -> bool:
    """Plain eager execution on a real tensor: call the kernel directly, no tracer needs to
    see the op (no dispatch mode such as fake tensors or make_fx, no functionalization or
    functorch wrapper, which are plain ``torch.Tensor`` objects on the Python side)."""
    return (
        type(x) is torch.Tensor
        and _only_observers()
        and not torch._is_functional_tensor(x)
        and not _functorch_wrapped(x)
    )


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def plain_eager() -> bool:
    """Whether the emitted program runs in plain eager mode (the value of its ``autopar_eager``
    node, passed to the ops' ``owned`` / ``alias`` arguments).

    Why here and not inside the ops: code that torch.compile produced calls the ops with real
    tensors and no mode active, exactly like eager code, so an op cannot tell the two apart at
    run time. The emitted forward asks once, in Python, where Dynamo sees the question: it
    evaluates ``torch.compiler.is_compiling()`` as True while tracing, so compiled graphs hold
    ``owned=False, alias=False`` and every op there is functional, as its schema says. A
    dispatch mode (fake tensors, make_fx) may record the ops, so under one they are functional
    too, unless every mode active says it only observes (``observer = True``, e.g. the memory
    counter runtime/live_bytes.LiveBytes, which must measure the step as it runs unobserved).
    """
    return not torch.compiler.is_compiling() and (_only_observers() or _EMULATED[0])


# A dry run (dryrun/run.py) executes the program on fake tensors to measure what plain eager
# execution allocates: under ``eager_emulated()`` the program takes its plain-eager choices (the
# ``alias`` / ``owned`` flags) and the identity forwards below run their eager path (returning
# their input where aliased), as on real tensors; every other op still dispatches, so the dry
# run's counters see it. Without this the dry run counted a copy the real program never makes
# (scale_grad's clone of a dp-split output: the logits, a tenth of a small GPT's peak).
_EMULATED = [False]
LOCAL_FORWARD = frozenset({"grad_all_reduce", "scale_grad"})  # identity forwards: no collective in them


@contextlib.contextmanager
def eager_emulated():
    """Run autopar's ops as plain eager mode runs them, on fake tensors (a dry run)."""
    before, _EMULATED[0] = _EMULATED[0], True
    try:
        yield
    finally:
        _EMULATED[0] = before


def _only_observers() -> bool:
    """No dispatch mode is active, or each active one only observes (``observer = True``)."""
    n = torch._C._len_torch_dispatch_stack()
    return n == 0 or all(getattr(torch._C._get_dispatch_stack_at(i), "observer", False) for i in range(n))


def _define(name: str, schema: str, kernel, fake, backward, saved: tuple, eager=None, tensors: int = 1) -> None:
    """Define ``autopar::name`` with ``kernel`` (real tensors), ``fake`` (shapes only) and
    ``backward(ctx, grad) -> grads`` reading the ``saved`` argument names from ctx.

    ``eager`` (default: ``kernel``) is what the autograd forward runs in plain eager mode. It
    may work in place or return its input (an autograd.Function output, as in Megatron's f)
    only where the op's ``owned`` / ``alias`` argument says so, and the emitted program sets
    that argument from ``plain_eager()``: False in compiled code, where the op must then be
    exactly what its schema says (a fresh output, no mutation). ``saved`` names the arguments
    after the first ``tensors`` (the tensor arguments, which are not kept).
    """
    _LIB.define(name + schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"autopar::{name}", fake, lib=_LIB)
    op = getattr(ops, name).default
    run_eager = eager or kernel

    def forward(ctx, *args):
        for key, value in zip(saved, args[tensors:]):
            setattr(ctx, key, value)
        if _fast(args[0]) or (_EMULATED[0] and name in LOCAL_FORWARD):
            return run_eager(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    fn = type(
        f"{name}_autograd",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    _LIB.impl(name, fn.apply, "Autograd")
    _FUNCTIONS[name] = fn
    _EAGER[name] = (op, run_eager, backward, saved)
    _KERNELS[op] = kernel


_FUNCTIONS: dict = {}  # op name -> its autograd.Function (what its Autograd kernel runs)
_KERNELS: dict = {}  # op overload -> its kernel (the backend's collective; a dry run calls it on fake tensors)


def collective_kernel(op):
    """The kernel that runs autopar collective ``op`` on the current backend (None for another op):
    what a dry run calls where a fake tensor would take the op's shapes-only kernel."""
    return _KERNELS.get(op)


_EAGER: dict = {}  # op name -> (op overload, eager kernel, backward, saved argument names)


def eager_caller(name: str):
    """A Python callable for op ``name`` as the emitted program calls it (codegen/fast_calls.py):
    in plain eager mode an autograd.Function of the call site (``site_function``), otherwise
    (torch.compile, a tracing mode) the op itself. None for an autopar op defined elsewhere
    (random draws).

    Why: the dispatcher's round trip to the op's Autograd kernel costs about 10 us a call, and
    a Function that takes the op's constants as arguments and stores them on its ``ctx`` about
    as much again (the first attribute set on a ``ctx`` makes its ``__dict__``). A call site's
    Function takes the tensor alone, its constants are class attributes, as the constants of a
    hand-written Megatron f or g are in its code: one ``apply(x)``, the same per-call cost."""
    if name not in _EAGER:
        return None
    op = getattr(ops, name).default
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    if any(str(a.type).startswith("Tensor") for a in arguments[1:]):  # counts as tensors: the op's Function
        return _generic_caller(name)
    params = ", ".join(a.name + (f"={a.default_value!r}" if a.has_default_value() else "") for a in arguments)
    key = ", ".join("tuple(group)" if n == "group" else n for n in names[1:])
    source = (
        f"def eager_{name}({params}):\n"
        f"    if not _plain_eager():\n"
        f"        return _op({', '.join(names)})\n"
        f"    key = ({key},)\n"
        f"    fn = _sites.get(key)\n"
        f"    if fn is None:\n"
        f"        fn = _new_site(key)\n"
        f"    return fn.apply({names[0]})\n"
    )
    sites: dict = {}

    def new_site(key):
        if len(sites) >= _SITES:  # a constant that varies per call (an uneven batch's share): bounded
            sites.clear()
        sites[key] = site_function(name, key)
        return sites[key]

    scope = {"_plain_eager": plain_eager, "_op": op, "_sites": sites, "_new_site": new_site}
    exec(compile(source, f"<autopar eager {name}>", "exec"), scope)  # noqa: S102 - generated from the schema
    return scope[f"eager_{name}"]


_SITES = 1024  # call-site Functions kept per op


def site_function(name: str, consts: tuple):
    """An autograd.Function computing op ``name`` on its one tensor argument with the other
    arguments fixed to ``consts``: they are class attributes of its backward node (the op's
    ``ctx``), where the op's backward reads them, so no call stores anything on a ``ctx``."""
    op, run_eager, backward, saved = _EAGER[name]
    arguments = op._schema.arguments[1:]
    consts = tuple(consts)

    local = name in LOCAL_FORWARD

    def forward(ctx, x):  # the caller saw plain eager mode: the tensor alone is left to check
        if type(x) is torch.Tensor and not torch._is_functional_tensor(x) and not _functorch_wrapped(x):
            return run_eager(x, *consts)
        if local and _EMULATED[0]:
            return run_eager(x, *consts)
        with torch._C._AutoDispatchBelowAutograd():
            return op(x, *consts)

    fn = type(
        f"{name}_site",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    for a, value in zip(arguments, consts):
        if a.name in saved:
            setattr(fn._backward_cls, a.name, value)
    return fn


def _generic_caller(name: str):
    """The call of an op with more than one tensor argument: its Function with every argument."""
    op, fn = getattr(ops, name).default, _FUNCTIONS[name]
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    defaults = [a.default_value if a.has_default_value() else None for a in arguments]
    n = len(names)

    def call(*args, **kwargs):
        if not plain_eager():
            return op(*args, **kwargs)
        if kwargs or len(args) < n:
            args = args + tuple(kwargs.get(k, d) for k, d in zip(names[len(args) :], defaults[len(args) :]))
        return fn.apply(*args)

    call.__name__ = call.__qualname__ = f"eager_{name}"
    return call


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
    if owned and backend.supports_in_place:
        return backend.all_reduce_(x, tuple(group), rank, op)
    return backend.all_reduce(x, tuple(group), rank, op)


def all_gather(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """S(dim) -> R: concatenate the group's pieces along ``dim``."""
    return current_backend().all_gather(x, dim, tuple(group), rank)


def reduce_scatter(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int, op: str) -> torch.Tensor:
    """P -> S(dim): reduce over the group, keep this rank's chunk of ``dim``."""
    return current_backend().reduce_scatter(x, dim, tuple(group), rank, op)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim): regroup the pieces."""
    return current_backend().all_to_all(x, src_dim, dst_dim, tuple(group), rank)


def shard(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """R -> S(dim): keep this rank's chunk, locally (backward all-gathers)."""
    n = len(group)
    size = x.shape[dim] // n
    # contiguous, as the fake kernel says: a plain clone keeps a permuted input's layout, and
    # inductor's stride asserts then failed (a compiled tp module's backward, attention heads)
    return x.narrow(dim, _pos(group, rank) * size, size).clone(memory_format=torch.contiguous_format)


def to_partial(x: torch.Tensor, axis: str, group: list[int], rank: int, op: str) -> torch.Tensor:
    """R -> P: the first rank of the group keeps the value, the others hold zeros (avg: all keep it)."""
    if op == "avg" or _pos(group, rank) == 0:
        return x.clone()
    return torch.zeros_like(x)


def grad_all_reduce(
    x: torch.Tensor, axis: str, group: list[int], rank: int, alias: bool = False, grad_owned: bool = False
) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's "f").

    Placed where a replicated tensor feeds computation that is split on ``axis``: each rank's
    gradient is then only its part's contribution, and the sum over the group is the whole.

    ``grad_owned``: the emitter saw that only matmul-like ops read the output (their backward
    makes the gradient afresh, nothing else holds it) and the program runs in plain eager mode:
    the backward may then reduce the gradient in place, as Megatron's f does, instead of
    copying it first.
    """
    return x.clone()


def scale_grad(x: torch.Tensor, axis: str, factor: float, alias: bool = False) -> torch.Tensor:
    """Identity forward, gradient times ``factor`` backward.

    On outputs left split over the data-parallel axis: each rank's loss is then the mean over
    its own slice of the batch, and averaging the gradients over the axis (as DDP does) makes
    them the serial model's.
    """
    return x.clone()


def _grad_all_reduce_eager(x, axis, group, rank, alias=False, grad_owned=False):
    """The eager path of an identity op: its input itself where the program allowed it
    (``alias``, from ``plain_eager()``), else a fresh copy as the schema promises."""
    return x if alias else x.clone()


def _scale_grad_eager(x, axis, factor, alias=False):
    return x if alias else x.clone()


def all_to_all_v(
    x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, axis: str, group: list[int], rank: int
) -> torch.Tensor:
    """Rows of ``x`` to the group's ranks in variable numbers (MoE token dispatch): the first
    ``send_counts[0]`` rows to the group's first rank, the next ``send_counts[1]`` to the second,
    ...; the result holds ``recv_counts[i]`` rows from the i-th rank, in group order. A count
    may be zero. The counts are tensors (a program computes them from the routing) of length
    the group size; each rank's ``recv_counts`` must be what the others send it."""
    return current_backend().all_to_all_v(x, send_counts.tolist(), recv_counts.tolist(), tuple(group), rank)


def ring_shift(x: torch.Tensor, offset: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """Send ``x`` to the rank ``offset`` places later on the axis (a ring); return what the rank
    ``offset`` places earlier sent (ring attention's step). Backward shifts the gradient back."""
    return current_backend().ring_shift(x, tuple(group), rank, offset)


_KERNELS = {
    f.__name__: f
    for f in (
        ring_shift,
        all_reduce,
        all_gather,
        reduce_scatter,
        all_to_all,
        shard,
        to_partial,
        grad_all_reduce,
        scale_grad,
        all_to_all_v,
    )
}


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


def _all_to_all_v_fake(x, send_counts, recv_counts, axis, group, rank):
    rows = torch.library.get_ctx().new_dynamic_size()  # known only from the counts' values
    return x.new_empty((rows, *x.shape[1:]))


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


def _all_to_all_v_bwd(ctx, g):
    # the rows came back the way they went: what this rank received it now sends
    back = _call("all_to_all_v", g.contiguous(), ctx.recv_counts, ctx.send_counts, ctx.axis, ctx.group, ctx.rank)
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
    g = g.contiguous()
    if getattr(ctx, "grad_owned", False) and _fast(g) and not (torch.is_grad_enabled() and g.requires_grad):
        backend = current_backend()
        if backend.supports_in_place:  # a fresh gradient nothing else reads: reduced in place
            return backend.all_reduce_(g, tuple(ctx.group), ctx.rank, "sum"), None, None, None, None, None
    return _call("all_reduce", g, ctx.axis, ctx.group, ctx.rank, "sum"), None, None, None, None, None


def _ring_shift_bwd(ctx, g):
    return _call("ring_shift", g.contiguous(), -ctx.offset, ctx.axis, ctx.group, ctx.rank), None, None, None, None


def _scale_grad_bwd(ctx, g):
    return g * ctx.factor, None, None, None


_G = "str axis, int[] group, int rank"
_define(
    "all_reduce",
    f"(Tensor x, {_G}, str op, bool owned=False) -> Tensor",
    all_reduce,
    _same,
    _all_reduce_bwd,
    ("axis", "group", "rank", "op"),
    eager=_all_reduce_eager,
)
_define(
    "all_gather",
    f"(Tensor x, int dim, {_G}) -> Tensor",
    all_gather,
    _gather_fake,
    _all_gather_bwd,
    ("dim", "axis", "group", "rank"),
)
_define(
    "reduce_scatter",
    f"(Tensor x, int dim, {_G}, str op) -> Tensor",
    reduce_scatter,
    _split_fake,
    _reduce_scatter_bwd,
    ("dim", "axis", "group", "rank", "op"),
)
_define(
    "all_to_all",
    f"(Tensor x, int src_dim, int dst_dim, {_G}) -> Tensor",
    all_to_all,
    _all_to_all_fake,
    _all_to_all_bwd,
    ("src_dim", "dst_dim", "axis", "group", "rank"),
)
_define(
    "all_to_all_v",
    f"(Tensor x, Tensor send_counts, Tensor recv_counts, {_G}) -> Tensor",
    all_to_all_v,
    _all_to_all_v_fake,
    _all_to_all_v_bwd,
    ("send_counts", "recv_counts", "axis", "group", "rank"),
)
_define(
    "shard", f"(Tensor x, int dim, {_G}) -> Tensor", shard, _split_fake, _shard_bwd, ("dim", "axis", "group", "rank")
)
_define(
    "to_partial",
    f"(Tensor x, {_G}, str op) -> Tensor",
    to_partial,
    _same,
    _to_partial_bwd,
    ("axis", "group", "rank", "op"),
)
_define(
    "grad_all_reduce",
    f"(Tensor x, {_G}, bool alias=False, bool grad_owned=False) -> Tensor",
    grad_all_reduce,
    _same,
    _grad_all_reduce_bwd,
    ("axis", "group", "rank", "alias", "grad_owned"),
    eager=_grad_all_reduce_eager,
)
_define(
    "ring_shift",
    f"(Tensor x, int offset, {_G}) -> Tensor",
    ring_shift,
    _same,
    _ring_shift_bwd,
    ("offset", "axis", "group", "rank"),
)
_define(
    "scale_grad",
    "(Tensor x, str axis, float factor, bool alias=False) -> Tensor",
    scale_grad,
    _same,
    _scale_grad_bwd,
    ("axis", "factor"),
    eager=_scale_grad_eager,
)


# ------------------------------------------------------- all-gather, reduce-scatter backward
def all_gather_rs(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """S(dim) -> R forward; the backward reduce-scatters a partial gradient back to S(dim)."""
    return all_gather(x, dim, axis, group, rank)


def _all_gather_rs_bwd(ctx, g):
    return (
        _call("reduce_scatter", g.contiguous(), ctx.dim, ctx.axis, ctx.group, ctx.rank, "sum"),
        None,
        None,
        None,
        None,
    )


_define(
    "all_gather_rs",
    f"(Tensor x, int dim, {_G}) -> Tensor",
    all_gather_rs,
    _gather_fake,
    _all_gather_rs_bwd,
    ("dim", "axis", "group", "rank"),
)


# ---------------------------------------------- two tensors in one op: an order compile keeps
# Context parallel's K and V are gathered (and their gradients reduce-scattered) by two
# collectives that do not depend on each other. As two ops, inductor's scheduler may order them
# differently on ranks whose graphs differ (load balancing gives each rank its own block plan):
# rank 0 then reduce-scattered dV against rank 1's dK (found by the compiled context-parallel
# test). One op runs both in a fixed order, the same two collectives as before, eager or compiled.
def all_gather_rs_pair(a: torch.Tensor, b: torch.Tensor, dim: int, axis: str, group: list[int], rank: int):
    """``all_gather_rs`` of ``a`` then of ``b`` (S(dim) -> R; backward: the two reduce-scatters)."""
    return all_gather(a, dim, axis, group, rank), all_gather(b, dim, axis, group, rank)


def reduce_scatter_pair(a: torch.Tensor, b: torch.Tensor, dim: int, axis: str, group: list[int], rank: int, op: str):
    """``reduce_scatter`` of ``a`` then of ``b``, in this order on every rank."""
    return reduce_scatter(a, dim, axis, group, rank, op), reduce_scatter(b, dim, axis, group, rank, op)


def _pair_fake(fake):
    return lambda a, b, *args: (fake(a, *args), fake(b, *args))


def _all_gather_rs_pair_bwd(ctx, ga, gb):
    args = (ctx.dim, ctx.axis, ctx.group, ctx.rank, "sum")
    return (*_call("reduce_scatter_pair", ga.contiguous(), gb.contiguous(), *args), None, None, None, None)


def _reduce_scatter_pair_bwd(ctx, ga, gb):
    args = (ctx.dim, ctx.axis, ctx.group, ctx.rank)
    return (*_call("all_gather_rs_pair", ga.contiguous(), gb.contiguous(), *args), None, None, None, None, None)


_KERNELS.update(all_gather_rs_pair=all_gather_rs_pair, reduce_scatter_pair=reduce_scatter_pair)
_define(
    "all_gather_rs_pair",
    f"(Tensor a, Tensor b, int dim, {_G}) -> (Tensor, Tensor)",
    all_gather_rs_pair,
    _pair_fake(_gather_fake),
    _all_gather_rs_pair_bwd,
    ("dim", "axis", "group", "rank"),
    tensors=2,
)
_define(
    "reduce_scatter_pair",
    f"(Tensor a, Tensor b, int dim, {_G}, str op) -> (Tensor, Tensor)",
    reduce_scatter_pair,
    _pair_fake(_split_fake),
    _reduce_scatter_pair_bwd,
    ("dim", "axis", "group", "rank", "op"),
    tensors=2,
)
