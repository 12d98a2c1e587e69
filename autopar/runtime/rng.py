"""Randomness derived from placements: dropout masks that agree where the tensor is one value.

The contract (docs/randomness.md): a tensor replicated on a mesh axis is the same value on
every rank of that axis, so its dropout mask must be the same there; a tensor split on an
axis holds a different piece on each rank, so each rank draws its own piece. Two modes:

- ``rng="placement"`` (default): each rank draws a mask of its local shape from a stream
  keyed by the shared state and by its coordinates on the axes that split the tensor only.
  Ranks that hold the same piece (they differ on replicated axes only) draw the same mask.
- ``rng="serial"``: every rank draws the serial model's full-size mask, exactly as
  ``nn.Dropout`` does on CPU (``empty(shape).bernoulli_(1 - p) / (1 - p)``, one draw of the
  generator per mask), and keeps its piece of it by the tensor's placements. With the rank
  modules seeded like the serial model (``ap.manual_seed``), dropout equals serial bit for bit
  under any plan. It costs a full-size mask per rank.

State: every rank module holds one generator state as a buffer (``autopar_rng_state``, not
saved in state_dict). All ranks start from the same seed (the plan's ``seed``, default
``torch.initial_seed()`` when planning; ap.parallelize broadcasts replicated buffers, so ranks
that planned with different seeds agree after compile) and advance it identically (one draw
per dropout call whatever the rank holds), so they agree every step with no communication.

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), annotations=..., rng="serial")
    >>> torch.manual_seed(0); serial_out = model(x)
    >>> ap.manual_seed(plan.module(r), 0)      # per rank: the same masks as the serial model
"""

from __future__ import annotations

import contextlib

import torch

from autopar.errors import PlanError
from autopar.placement import narrow_piece, piece_size, to_zigzag

STATE = "autopar_rng_state"
MODES = ("placement", "serial")
_SERIAL, _PLACEMENT = 1, 0
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads a rank's key over the seed space

_LIB = torch.library.Library("autopar", "FRAGMENT")  # noqa: TOR901 - a mutating op, see below
_LIB.define(
    "dropout_mask(Tensor(a!) state, SymInt[] shape, float p, ScalarType dtype, Device device, "
    "int[] cuts, int kind, int[] order=[]) -> Tensor"
)


def check_mode(rng: str) -> str:
    if rng not in MODES:
        raise PlanError(
            f"rng={rng!r}: choose 'placement' (masks agree on replicated axes, "
            "the default) or 'serial' (masks equal the serial model's)."
        )
    return rng


def initial_state(seed: int) -> torch.Tensor:
    """The generator state every rank module starts from (torch.manual_seed(seed)'s state)."""
    return torch.Generator().manual_seed(int(seed)).get_state()


def manual_seed(module: torch.nn.Module, seed: int) -> None:
    """Seed a rank module's dropout (or each stage module of a pipeline runner) like
    ``torch.manual_seed(seed)`` seeds the serial model's: in ``rng="serial"`` mode the next
    forward draws the serial model's masks. Call it on every rank with the same seed."""
    found = False
    for m in getattr(module, "stage_modules", None) or [module]:
        for name, buf in m.named_buffers():
            if name.rsplit(".", 1)[-1] == STATE:
                buf.copy_(initial_state(seed))
                found = True
    if not found:
        raise PlanError(
            f"{type(module).__name__} has no dropout randomness (no {STATE} buffer): "
            "pass a rank module of a plan whose model uses dropout."
        )


def attach_state(gm: torch.nn.Module, plan) -> None:
    """Give ``gm`` its generator state if its program draws masks (non-persistent buffer)."""
    if any(n.op == "get_attr" and n.target == STATE for n in gm.graph.nodes):
        gm.register_buffer(STATE, initial_state(plan.options.seed), persistent=False)


def dropout(
    x: torch.Tensor,
    p: float,
    train: bool,
    state: torch.Tensor,
    factors: list[int],
    cuts: list[int],
    mode: int,
    order: list[int] = (),
) -> torch.Tensor:
    """What one dropout becomes on a rank (the emitted program calls it; see lowering_modes).

    ``factors[d]``: into how many pieces dim d of the global tensor is cut; ``cuts``: for each
    axis that splits it, (dim, pieces, this rank's coordinate, blocks, global size or 0 where it
    is sized at run time and cut evenly, 1 where the axis's pieces are in the zig-zag order),
    flattened, axis order (CUT entries each).
    """
    if not train or p == 0.0:
        return torch.ops.aten.dropout.default(x, p, train)
    shape = full_shape([s * f for s, f in zip(x.shape, factors)], cuts) if mode == _SERIAL else list(x.shape)
    mask = torch.ops.autopar.dropout_mask(state, shape, p, x.dtype, x.device, cuts, mode, list(order))
    return x * mask


def _kernel(state, shape, p, dtype, device, cuts, mode, order=()):
    gen = torch.Generator().set_state(state)
    if mode == _SERIAL:
        mask = _draw(shape, p, dtype, gen, device, order)
        state.copy_(gen.get_state())
        return _piece(mask, cuts).contiguous()
    key = int(torch.randint(-(2**63), 2**63 - 1, (), generator=gen))
    state.copy_(gen.get_state())
    for i in range(0, len(cuts), CUT):  # only the axes that split the tensor tell ranks apart
        key = (key * _MIX + (cuts[i] + 1) * 1009 + cuts[i + 2] + 1) % (2**63)
    return _draw(shape, p, dtype, torch.Generator().manual_seed(key), device)


def _draw(shape, p, dtype, gen, device, order=()):
    """nn.Dropout's CPU mask: bernoulli(1 - p) scaled by 1 / (1 - p) (zeros when p == 1), laid out
    in memory as its input (ATen's ``empty_like(input).bernoulli_``: a transposed input's mask is
    drawn in the transposed order)."""
    mask = empty_in_order(shape, order, dtype).bernoulli_(1 - p, generator=gen)
    mask = mask.div_(1 - p) if p < 1 else mask
    return mask.to(device)


CUT = 6  # entries per axis in ``cuts``: (dim, pieces, coordinate, blocks, global size or 0, zig-zag)


def _piece(full, cuts):
    """This rank's piece of a full-size tensor, as placement.shard_tensor cuts it; on an axis
    whose pieces are in the zig-zag order (load-balanced context parallel: placement.py's orders)
    its chunks ``coordinate`` and 2 pieces - 1 - ``coordinate``, as plan.local_inputs cuts."""
    out = full
    for i in range(0, len(cuts), CUT):
        dim, n, coord, blocks, _, zigzag = cuts[i : i + CUT]
        if zigzag:
            out = to_zigzag(out, dim, n, blocks)
        out = narrow_piece(out, dim, n, coord, blocks)
    return out


def full_shape(shape, cuts) -> list:
    """``shape`` with each cut dim's global size where ``cuts`` knows it (uneven pieces)."""
    out = list(shape)
    for i in range(0, len(cuts), CUT):
        if cuts[i + 4]:
            out[cuts[i]] = cuts[i + 4]
    return out


def local_shape_of(shape, cuts) -> list:
    """This rank's piece's shape of a full ``shape`` (placement.local_shape from the cuts)."""
    out = list(shape)
    for i in range(0, len(cuts), CUT):
        dim, n, coord, blocks = cuts[i : i + 4]
        out[dim] = blocks * piece_size(out[dim] // blocks, n, coord)
    return out


def serial_order(plan_traced, model, node) -> list[int]:
    """The memory order of ``node``'s value in the serial model (see order_of): measured once per
    trace by running the traced graph eagerly on the CPU kernels the serial model uses (fake
    tensors' strides are the meta kernels', which differ for some ops: batch_norm's output is
    contiguous on CPU, not laid out like its input), else read from the trace."""
    orders = _measured_orders(plan_traced, model)
    return orders[node.name] if node.name in orders else order_of(node.meta.get("val"))


def _measured_orders(traced, model) -> dict:
    cache = traced.gm.meta.get("autopar_serial_orders")
    if cache is not None:
        return cache
    cache = {}
    feeds = _serial_feeds(traced, model)
    if feeds is not None:

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if isinstance(out, torch.Tensor):
                    cache[n.name] = order_of(out)
                return out

        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            Recorder(traced.gm).run(*feeds)
    traced.gm.meta["autopar_serial_orders"] = cache
    return cache


def _serial_feeds(traced, model) -> list | None:
    """The traced graph's placeholders as the serial model would feed them: its parameters and
    (copied) buffers, and example-shaped inputs (values do not decide layouts); None for a model
    on the meta device or a trace without example inputs."""
    import torch.utils._pytree as pytree

    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    if getattr(traced, "example", None) is None or any(t.device.type == "meta" for t in named.values()):
        return None
    inputs = dict(zip(traced.user_inputs, pytree.tree_leaves(traced.example)))
    feeds = []
    for name, node in traced.placeholders().items():
        fqn = traced.param_fqn.get(name) or traced.buffer_fqn.get(name)
        if fqn is not None:
            feeds.append(named[fqn].detach().clone())
        elif name in traced.constant_fqn:
            feeds.append(traced.constants[traced.constant_fqn[name]])
        else:
            v = inputs.get(name)
            feeds.append(torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
    return feeds


def order_of(val) -> list[int]:
    """The serial tensor's dims from outermost to innermost in memory, from its traced value
    (example sizes and strides), when it is dense but not contiguous: ATen draws a random fill
    into ``empty_like`` of it, which keeps that layout (a transposed activation's mask is drawn in
    the transposed order); [] otherwise. From the trace, not the rank's piece: a rank's program
    may lay a value out otherwise than the serial model did."""
    if not isinstance(val, torch.Tensor):
        return []
    shape, stride = [_hint(s) for s in val.shape], [_hint(s) for s in val.stride()]
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    expected = 1
    for d in reversed(order):  # dense: each dim's stride is the product of the sizes inside it
        if shape[d] != 1 and stride[d] != expected:
            return []
        expected *= shape[d]
    return [] if order == sorted(order) else order


def _hint(s) -> int:
    return int(s.node.hint) if isinstance(s, torch.SymInt) and s.node.hint is not None else int(s)


def empty_in_order(shape, order, dtype) -> torch.Tensor:
    """An empty tensor of ``shape`` laid out in memory in dim ``order`` (outermost first)."""
    if not order:
        return torch.empty(shape, dtype=dtype)
    laid = torch.empty([shape[d] for d in order], dtype=dtype)
    return laid.permute([list(order).index(d) for d in range(len(shape))])


def _fake(state, shape, p, dtype, device, cuts, mode, order=()):
    out_shape = local_shape_of(shape, cuts) if mode == _SERIAL else list(shape)
    return torch.empty(out_shape, dtype=dtype, device=device)


_LIB.impl("dropout_mask", _kernel, "CompositeExplicitAutograd")
torch.library.register_fake("autopar::dropout_mask", _fake, lib=_LIB)


def rng_state(module: torch.nn.Module) -> torch.Tensor | None:
    """A copy of ``module``'s dropout generator state (None if it draws no masks)."""
    buf = getattr(module, STATE, None)
    return None if buf is None else buf.clone()


@contextlib.contextmanager
def replayed_state(states: list, snapshots: list):
    """Run with each of ``states`` (the generator state, running statistics) at its snapshot
    (a recompute draws the forward's draws again: an activation checkpoint region's, a pipeline
    stage's), then put back what they held (the step's later draws and the statistics are as if
    nothing was recomputed)."""
    now = [s.clone() for s in states]
    with torch.no_grad():
        for s, snap in zip(states, snapshots):
            s.copy_(snap)
    try:
        yield
    finally:
        with torch.no_grad():
            for s, kept in zip(states, now):
                s.copy_(kept)


@contextlib.contextmanager
def replayed_rng(module: torch.nn.Module, state: torch.Tensor | None):
    """Run with ``module``'s generator at ``state`` (a pipeline stage's recompute draws the
    forward's masks again), then put back the state it had: ``replayed_state``, as an
    activation checkpoint region's recompute does (parallel/activation_checkpoint/recompute.py)."""
    buf = getattr(module, STATE, None)
    if buf is None or state is None:
        yield
        return
    with replayed_state([buf], [state]):
        yield
