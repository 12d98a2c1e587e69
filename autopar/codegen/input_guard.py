"""A cheap check at the start of every emitted module: are these the rank's *local* inputs?

A rank's module expects its piece of each input (``plan.local_inputs(rank, ...)``). Passing
the global batch instead is the most common mistake, and without a check it either fails
deep inside with a shape error or, worse, runs. The emitted graph therefore starts with one
``check_local_inputs`` node that compares each input's shape with the planned layout:
static dims must have exactly the local size; dynamic dims (batch, sequence) may take any
size, but inputs that share a dynamic dim must agree on its global size.

What is and is not caught (a rank sees only its own inputs, and the check costs no
communication):
- a static dim (``dynamic=False``, or a dim export specialised) of the wrong size: caught,
  and named as "the global input" when it is the local size times the pieces;
- inputs sharing a dynamic dim that disagree (global ids with local labels): caught, also where
  export gave their batch dims separate symbols (a loss over flattened rows relates only their
  products): data-parallel inputs whose dim 0 had one size in the example must agree on it;
- an input of another dtype than traced (float64 pixels for a float32 model): caught (under a
  precision policy any floating dtype, which the policy casts);
- a dynamic size the plan splits that does not divide by the pieces: caught;
- the global batch passed as *every* input of a dynamic-batch plan: NOT caught. It is a
  valid local batch of a bigger global batch; only comparing ranks could tell (each dp rank
  would see the same data). Plan with ``dynamic=False`` to have it refused.

Example:
    >>> gm = plan.module(1)
    >>> gm(x)                   # x is the global batch
    autopar.errors.InputError: rank 1's module got input 'x' of shape (8, 6) ... pass plan.local_inputs(1, ...)
"""

from __future__ import annotations

import math

import torch
from torch.fx.node import has_side_effect

from autopar.errors import InputError
from autopar.placement import Shard, fmt_spec, local_shape, shard_factor
from autopar.sharding.propagate import input_requires_grad, tensor_outputs


def guard_args(plan, env: dict, rank: int) -> tuple | None:
    """The arguments of the guard node for ``rank`` (None when the model has no tensor input)."""
    phs = {n.name: n for n in plan.graph.nodes if n.op == "placeholder"}
    checks, values, vals = [], [], []
    for name in plan.traced.user_inputs:
        val, lay = phs[name].meta.get("val"), phs[name].meta.get("autopar")
        if isinstance(val, torch.Tensor) and lay is not None and lay.spec is not None:
            checks.append(input_checks(name, val, lay.spec, plan.mesh))
            values.append(env[phs[name]])
            vals.append((name, val, lay.spec))
    if not checks:
        return None
    # on a ragged axis (an uneven example batch) any batch runs: no size split there must divide,
    # and the batch links (local size times pieces) cannot tell a global size from a rank's
    divisors = symbol_divisors(plan.graph, plan.mesh, plan.ragged)
    links = () if plan.batch_axis in plan.ragged else batch_links(vals, plan.batch_axis)
    dtypes = expected_dtypes(vals, plan)
    return tuple(values), tuple(checks), rank, divisors, links, dtypes, planned_without_grad(plan)


def batch_links(vals: list, dp_axis: int | None) -> tuple:
    """(input, dim 0, key) for the inputs whose dim 0 is the batch the data-parallel axis splits
    and was one size in the example (ids and labels: export may give their batch dims separate
    symbols when nothing in the graph relates them, as a loss over flattened rows does). Such
    dims must agree at run time: global ids with local labels are caught before the model's own
    loss complains."""
    if dp_axis is None:
        return ()
    by_key: dict[str, list] = {}
    for name, val, spec in vals:
        s = val.shape[0] if val.dim() else None
        if isinstance(spec[dp_axis], Shard) and spec[dp_axis].dim == 0 and isinstance(s, torch.SymInt):
            if s.node.expr.is_Symbol and s.node.hint is not None:
                by_key.setdefault(f"batch of {s.node.hint}", []).append((name, str(s.node.expr)))
    links = []
    for key, members in by_key.items():
        if len({sym for _, sym in members}) > 1:  # the same symbol is checked as such already
            links += [(name, 0, key) for name, _ in members]
    return tuple(links)


def expected_dtypes(vals: list, plan) -> tuple:
    """The dtype each input must have: the traced one (the program was traced for it: a float64
    image where float32 was traced fails deep inside), or "floating" for floating inputs under a
    precision policy, which casts any floating input to its param_dtype."""
    policy = plan.traced.dtype is not None
    return tuple("floating" if policy and val.dtype.is_floating_point else val.dtype for _, val, _ in vals)


def planned_without_grad(plan) -> tuple[str, ...]:
    """The floating user inputs whose example did not require grad: the plan made no gradient
    flow for them, so one that requires grad at run time would get a wrong gradient."""
    phs = {n.name: n for n in plan.graph.nodes if n.op == "placeholder"}
    return tuple(
        name
        for name in plan.traced.user_inputs
        if isinstance(phs[name].meta.get("val"), torch.Tensor)
        and phs[name].meta["val"].dtype.is_floating_point
        and not input_requires_grad(phs[name])
    )


def symbol_divisors(graph, mesh, skip_axes=frozenset()) -> tuple:
    """(symbol, k, node) for each dynamic size the plan cuts into k pieces somewhere (at ``node``).

    A dynamic dim may be split inside the graph (an intermediate's batch dim on some axis):
    the runtime size must then divide by the pieces, or a rank would hold a ragged piece.
    ``skip_axes``: axes whose pieces may differ (Plan.ragged), not counted.
    """
    found: dict[str, tuple[int, str]] = {}
    for node in graph.nodes:
        lay = node.meta.get("autopar")
        if lay is None:
            continue
        for val, spec in zip([v for v in tensor_outputs(node) if v is not None], lay.outputs):
            if not any(isinstance(p, Shard) for p in spec):
                continue  # nothing cut (most values: checked first, it is the cheap test)
            for d, size in enumerate(val.shape):
                f = shard_factor([p if a not in skip_axes else None for a, p in enumerate(spec)], mesh, d)
                if f == 1 or not (isinstance(size, torch.SymInt) and size.node.expr.is_Symbol):
                    continue
                sym = str(size.node.expr)
                k, where = found.get(sym, (1, ""))
                if math.lcm(k, f) != k:
                    found[sym] = (math.lcm(k, f), node.name)
    return tuple((sym, k, where) for sym, (k, where) in sorted(found.items()))


def input_checks(name: str, val, spec, mesh) -> tuple:
    """What the guard checks for one input: (name, spec text, global shape, dims).

    Each dim is (local size or None when dynamic, shard factor, symbol or None); the local size
    of a static dim cut into uneven pieces is a tuple, each global rank's (placement.local_shape).
    """
    dims, global_shape = [], []
    static = tuple(int(s) if not isinstance(s, torch.SymInt) or s.node.expr.is_number else 0 for s in val.shape)
    per_rank = [local_shape(static, spec, mesh, mesh.coords(r)) for r in mesh.ranks()]
    for d, s in enumerate(val.shape):
        f = shard_factor(spec, mesh, d)
        if isinstance(s, torch.SymInt) and s.node.expr.is_number:  # specialised by export
            s = int(s.node.expr)
        if isinstance(s, torch.SymInt):
            dims.append((None, f, str(s.node.expr)))
            global_shape.append(str(s.node.expr))
        else:
            sizes = tuple(p[d] for p in per_rank)
            dims.append((sizes[0] if len(set(sizes)) == 1 else sizes, f, None))
            global_shape.append(int(s))
    return (name, fmt_spec(spec), tuple(global_shape), tuple(dims))


@has_side_effect
def check_local_inputs(
    values: tuple,
    checks: tuple,
    rank: int,
    divisors: tuple = (),
    links: tuple = (),
    dtypes: tuple = (),
    no_grad: tuple = (),
) -> None:
    """Raise InputError when ``values`` are not the local pieces the plan expects, or when an
    input named in ``no_grad`` (planned without a gradient) requires one.

    The verdict depends on the inputs' shapes, dtypes and requires_grad (and grad mode) only,
    so a signature seen to pass is remembered per program (``checks`` is the program's
    constant): a training loop's steps pay a tuple compare, not the walk over every dim.
    torch.compile traces the check itself (its shape tests become the graph's guards)."""
    if torch.compiler.is_compiling():
        _check(values, checks, rank, divisors, links, dtypes, no_grad)
        return
    key = [torch.is_grad_enabled(), rank]  # a loop, not a generator: no frame per input
    for v in values:
        key.append((v.shape, v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else None)
    signature = tuple(key)
    seen = _PASSED.get(id(checks))
    if seen is not None and seen[0] is checks and signature in seen[1]:
        return
    _check(values, checks, rank, divisors, links, dtypes, no_grad)
    if seen is None or seen[0] is not checks:
        seen = _PASSED[id(checks)] = (checks, set())
    if len(seen[1]) >= _REMEMBERED:  # varying sequence lengths: keep the memory bounded
        seen[1].clear()
    seen[1].add(signature)


_PASSED: dict[int, tuple] = {}  # id(checks) -> (checks, signatures that passed)
_REMEMBERED = 256


def _check(values, checks, rank, divisors, links, dtypes, no_grad) -> None:
    sizes: dict[str, tuple[int, str]] = {}  # dynamic symbol or batch link -> (global size, input that set it)
    need = {sym: (k, where) for sym, k, where in divisors}
    linked = {(name, d): key for name, d, key in links}
    for i, (value, (name, spec, global_shape, dims)) in enumerate(zip(values, checks)):
        if not isinstance(value, torch.Tensor):
            continue
        if name in no_grad and value.requires_grad and torch.is_grad_enabled():
            raise InputError(
                f"rank {rank}'s module got input {name!r} with requires_grad=True, but the plan was made "
                "from an example that does not require grad, so its gradient would arrive in parts. "
                f"Plan with an example {name!r} that requires grad (tensor.requires_grad_()), or pass it detached."
            )
        shape = tuple(value.shape)
        why = _mismatch(shape, dims, name, sizes, need, rank) or _wrong_dtype(value, dtypes[i] if dtypes else None)
        if why is None and linked:
            why = _unlinked(shape, dims, name, sizes, linked)
        if why is not None:
            expected = tuple(_local(n, rank) if n is not None else "*" for n, _, _ in dims)
            _fail(rank, name, shape, expected, spec, global_shape, why)


def _wrong_dtype(value: torch.Tensor, expected) -> str | None:
    if expected is None or value.dtype == expected:
        return None
    if expected == "floating":
        return None if value.is_floating_point() else f"it has dtype {value.dtype}, the plan expects a floating one"
    return f"it has dtype {value.dtype}, but the plan was traced with {expected}: pass it as .to({expected})"


def _unlinked(shape: tuple, dims: tuple, name: str, sizes: dict, linked: dict) -> str | None:
    """The batch dims of inputs that must agree (batch_links), checked like a shared symbol."""
    for d, (_, f, _) in enumerate(dims):
        key = linked.get((name, d))
        if key is None:
            continue
        full = shape[d] * f
        seen = sizes.setdefault(key, (full, name))
        if seen[0] != full:
            return (
                f"dim {d} is the batch (split on the data-parallel axis) and means a global size {full}, but "
                f"input {seen[1]!r} means {seen[0]}: one of them is global and the other local?"
            )
    return None


def _local(n, rank: int):
    """A static dim's local size on ``rank`` (a tuple: uneven pieces, one size per rank)."""
    return n[rank] if isinstance(n, tuple) else n


def _mismatch(shape: tuple, dims: tuple, name: str, sizes: dict, need: dict, rank: int = 0) -> str | None:
    """Why ``shape`` is not the local piece ``dims`` describes (None when it is); records each
    dynamic dim's global size in ``sizes`` so that inputs sharing the dim must agree."""
    if len(shape) != len(dims):
        return f"it has {len(shape)} dims, the plan expects {len(dims)}"
    for d, (n, f, sym) in enumerate(dims):
        n = _local(n, rank)
        if n is not None and shape[d] != n:
            if shape[d] == n * f and f > 1:
                return "it looks like the global input was passed where the local piece was expected"
            return f"dim {d} has size {shape[d]}, the plan expects {n}"
        if sym is not None:
            full = shape[d] * f
            k, where = need.get(sym, (1, ""))
            if full % k:
                return (
                    f"dim {d} means a global size {full}, but the plan splits that size into "
                    f"{k} pieces (at node {where!r}): use sizes divisible by {k}"
                )
            seen = sizes.setdefault(sym, (full, name))
            if seen[0] != full:
                return (
                    f"dim {d} means a global size {full}, but input {seen[1]!r} means {seen[0]} "
                    "for the same dim: one of them is global and the other local?"
                )
    return None


def _fail(rank, name, shape, expected, spec, global_shape, why):
    raise InputError(
        f"rank {rank}'s module got input {name!r} of shape {shape}, but expects its local piece "
        f"{expected} (layout {spec} of the global shape {global_shape}; '*' is any size): {why}. "
        f"Pass plan.local_inputs({rank}, *args, **kwargs) to the module, not the global batch."
    )
