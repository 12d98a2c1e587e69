"""Every random op, drawn by placement like dropout's masks (docs/randomness.md).

A tensor replicated on a mesh axis is one value: its random draws (``randn_like`` noise,
``bernoulli`` masks, an ``exponential_`` Gumbel trick in a sampling router, ``multinomial``
samples, SpecAugment-style ``uniform_`` masks) must be the same on every rank of the axis, and
a split tensor's its own piece of one draw. The emitted program calls one op,
``autopar::random_draw``, for all of them (sharding/lowerings/random_draws.py lowers each ATen random op
to it), with the rank module's generator state (rng.STATE) and the tensor's cuts:

- ``rng="placement"``: one 64-bit key is drawn from the shared state, mixed with the rank's
  coordinates on the axes that split the tensor, and the rank draws its local shape from it.
- ``rng="serial"``: the rank draws the serial model's full-size tensor from the shared state,
  exactly as the ATen op draws it on CPU (the same kernel on the same shape and generator), and
  keeps its piece. Ops whose draws read values (``bernoulli(p)``, ``multinomial(probs)``) run on
  a full-size tensor holding the rank's piece and a harmless filler elsewhere: their CPU kernels
  consume the generator the same way whatever the values, so the rank's piece is the serial one.
  ``poisson``'s draws depend on every rate: its rule keeps it replicated.

Kinds (``params``): uniform (from, to), normal (mean, std), exponential (lambd), cauchy
(median, sigma), log_normal (mean, std), geometric (p), bernoulli (p), bernoulli_tensor
(``like`` holds p), random ([] | [to] | [from, to]), multinomial (n, replacement; ``like``
holds the probabilities), poisson (``like`` holds the rates), randperm (n).

Example (rank 1 of tp=2, noise on an activation split on its last dim):
    >>> torch.ops.autopar.random_draw(state, h, [4, 8], "normal", [0.0, 1.0], None, [1, 2, 1, 1], 0, False)
"""

from __future__ import annotations

import math

import torch

from autopar.runtime.rng import _MIX, CUT, _piece, empty_in_order, full_shape, local_shape_of

_SERIAL, _PLACEMENT = 1, 0
FILLER = {"bernoulli_tensor": 0.5, "multinomial": 1.0}  # valid values where other ranks' pieces go

_LIB = torch.library.Library("autopar", "FRAGMENT")  # noqa: TOR901 - a mutating op, as rng.dropout_mask
_LIB.define(
    "random_draw(Tensor(a!) state, Tensor? like, SymInt[] shape, str kind, float[] params, "
    "ScalarType? dtype, int[] cuts, int rng_mode, bool reads_values, int[] order=[]) -> Tensor"
)


def sample(kind: str, shape, dtype, params, like, gen, order=()) -> torch.Tensor:
    """One draw of ``kind``, as the ATen op draws it on CPU (the same kernel, generator ``gen``,
    into a tensor laid out in dim ``order`` as ATen's ``empty_like`` of a transposed input is)."""
    if kind == "multinomial":
        return torch.multinomial(like, int(params[0]), bool(params[1]), generator=gen)
    if kind == "poisson":
        return torch.poisson(like, generator=gen)
    if kind == "randperm":
        return torch.randperm(int(params[0]), dtype=dtype, generator=gen)
    out = empty_in_order(shape, order, dtype)
    if kind == "bernoulli_tensor":
        return out.bernoulli_(like.to(dtype) if like.dtype != dtype else like, generator=gen)
    if kind == "random":
        return out.random_(*[int(p) for p in params], generator=gen)
    fill = {
        "uniform": out.uniform_,
        "normal": out.normal_,
        "exponential": out.exponential_,
        "cauchy": out.cauchy_,
        "log_normal": out.log_normal_,
        "geometric": out.geometric_,
        "bernoulli": out.bernoulli_,
    }[kind]
    return fill(*params, generator=gen)


def _full_shape(local_shape, cuts) -> list:
    full = list(local_shape)
    for i in range(0, len(cuts), CUT):
        full[cuts[i]] *= cuts[i + 1]
    return full_shape(full, cuts)


def _embed(local: torch.Tensor, cuts, filler: float, order=()) -> torch.Tensor:
    """A full-size tensor holding ``local`` where this rank's piece goes (placement.shard_tensor's
    cut, blocked shards included) and ``filler`` elsewhere, laid out in dim ``order``."""
    full_shape = _full_shape(local.shape, cuts)
    logical = torch.full(full_shape, filler, dtype=local.dtype)
    where = _piece(torch.arange(logical.numel()).view(full_shape), cuts)
    logical.view(-1)[where.reshape(-1)] = local.reshape(-1).cpu()
    return empty_in_order(full_shape, order, local.dtype).copy_(logical)


def _shapes(like, shape, kind, params, cuts, mode) -> tuple[list, list]:
    """(the shape drawn, the rank's output shape). ``shape`` given: the draw's (full in serial
    mode); empty with ``like``: like's local shape (multinomial: its rows and n samples)."""
    if shape or like is None:
        drawn = list(shape)
        local = list(drawn)
        if mode == _SERIAL:
            local = local_shape_of(drawn, cuts)
        return drawn, local
    local = list(like.shape[:-1]) + [int(params[0])] if kind == "multinomial" else list(like.shape)
    return (_full_shape(local, cuts) if mode == _SERIAL else local), local


def _dtype(kind, dtype, like):
    if kind == "multinomial":
        return torch.int64
    if dtype is not None:
        return dtype
    return like.dtype if like is not None else torch.get_default_dtype()


def _kernel(state, like, shape, kind, params, dtype, cuts, rng_mode, reads_values, order=()):
    mode = rng_mode  # (not named "mode" in the schema: inductor's functionalization takes that name)
    dtype, device = _dtype(kind, dtype, like), like.device if like is not None else torch.device("cpu")
    drawn, _ = _shapes(like, shape, kind, params, cuts, mode)
    gen = torch.Generator().set_state(state)
    if mode == _SERIAL:
        values = _embed(like, cuts, FILLER.get(kind, 1.0), order) if reads_values else None
        full = sample(kind, drawn, dtype, params, values, gen, order)
        state.copy_(gen.get_state())
        return _piece(full, cuts).contiguous().to(device)
    key = int(torch.randint(-(2**63), 2**63 - 1, (), generator=gen))
    state.copy_(gen.get_state())
    for i in range(0, len(cuts), CUT):  # only the axes that split the tensor tell ranks apart
        key = (key * _MIX + (cuts[i] + 1) * 1009 + cuts[i + 2] + 1) % (2**63)
    values = like.cpu() if reads_values else None
    return sample(kind, drawn, dtype, params, values, torch.Generator().manual_seed(key), order).to(device)


def _fake(state, like, shape, kind, params, dtype, cuts, rng_mode, reads_values, order=()):
    _, local = _shapes(like, shape, kind, params, cuts, rng_mode)
    return torch.empty(local, dtype=_dtype(kind, dtype, like), device=like.device if like is not None else "cpu")


_LIB.impl("random_draw", _kernel, "CompositeExplicitAutograd")
torch.library.register_fake("autopar::random_draw", _fake, lib=_LIB)


def feature_noise(x: torch.Tensor, p: float, train: bool, state, cuts, mode: int, alpha: bool, feature: bool, order=()):
    """Dropout2d / alpha_dropout / feature_alpha_dropout of ``x``, as ATen's _dropout_impl on
    CPU: a bernoulli(1 - p) noise of x's shape, or (feature) of (N, C, 1, ...), then scaled."""
    if not train or p == 0.0 or x.numel() == 0:
        return x
    if p == 1.0:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    local = list(x.shape[:2]) + [1] * (x.dim() - 2) if feature else list(x.shape)
    shape = _full_shape(local, cuts) if mode == _SERIAL else local
    layout = [] if feature else list(order)  # feature noise is a fresh (N, C, 1, ...) tensor; else empty_like(x)
    noise = torch.ops.autopar.random_draw(
        state, x.detach(), shape, "bernoulli", [1.0 - p], x.dtype, cuts, mode, False, layout
    )
    if not alpha:
        return x * noise.div_(1 - p)
    a_ = 1.7580993408473766  # SELU's alpha, as ATen's alpha dropout
    a = 1.0 / math.sqrt((a_ * a_ * p + 1) * (1 - p))
    b = noise.add(-1).mul_(a_ * a).add_(a_ * a * p)
    return (x * noise.mul_(a)).add_(b)


def sdpa_with_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, train, state, cuts, mode):
    """scaled_dot_product_attention with dropout on its weights drawn by placement: ATen's math
    form on CPU (what serial attention with dropout runs there), its ``at::dropout`` replaced by
    this rank's noise."""
    if not train:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    L, S = q.size(-2), k.size(-2)
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, -math.inf)
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    attn = (q * factor) @ (k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = torch.ops.aten._safe_softmax.default(attn, -1)
    if dropout_p == 1.0:
        return (attn * torch.zeros((), dtype=attn.dtype)) @ v
    shape = _full_shape(attn.shape, cuts) if mode == _SERIAL else list(attn.shape)
    noise = torch.ops.autopar.random_draw(
        state, attn.detach(), shape, "bernoulli", [1.0 - dropout_p], attn.dtype, cuts, mode, False
    )
    return (attn * noise.div_(1 - dropout_p)) @ v
