"""Every ATen random op of the traced graph becomes a draw that follows placements.

Dropout has its lowering in lowerings/train_modes.py; every other op tagged
``nondeterministic_seeded`` (torch's own mark for ops that consume the generator) is lowered
here to ``autopar::random_draw`` (runtime/random_draws.py): the rank module's generator state
and the cuts of the op's output, so replicas of a replicated tensor draw alike and split
pieces their own piece of one draw, in both rng modes. In-place fills (``x.exponential_()``)
draw into a new tensor and copy it into ``x``; ``normal(mean, std)`` draws N(0, 1) (or N(0, std))
and scales it as ATen does. Dropout2d, alpha dropout and attention dropout follow the module's
train()/eval() like dropout. A random op with no entry here is refused (a PlanError naming
it) rather than left to draw differently on every rank.

Example (a Gumbel router, ``logits - log(-log(u))`` with ``u = torch.rand_like(logits)``):
    rand_like = torch.ops.autopar.random_draw(autopar_rng_state, logits, [], 'uniform', [0.0, 1.0], None, [], 0, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.sharding.lowerings.train_modes import cuts_of, follows_mode, lower_dropout, training
from autopar.errors import ShardingError
from autopar.runtime import rng
from autopar.runtime.random_draws import feature_noise, sdpa_with_dropout

aten = torch.ops.aten


@dataclass
class Draw:
    """What one random op draws: ``kind`` with ``params`` over ``like``'s shape (or ``shape``)."""

    kind: str
    like: object = None  # the local tensor whose shape (and dtype, values) the draw takes
    params: list = field(default_factory=list)
    dtype: object = None
    reads_values: bool = False
    into: object = None  # an in-place fill's target
    shape: list = field(default_factory=list)  # creation ops: the size (replicated: global = local)


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _fill(kind, names_defaults):
    def spec(args, kwargs):
        params = [_arg(args, kwargs, i + 1, n, d) for i, (n, d) in enumerate(names_defaults)]
        return Draw(kind, args[0], params, into=args[0])

    return spec


def _random_(args, kwargs):
    bounds = [b for b in args[1:3] if b is not None] + [kwargs[k] for k in ("from", "to") if kwargs.get(k) is not None]
    return Draw("random", args[0], bounds, into=args[0])


def _created(kind, params_of, shape_at):
    def spec(args, kwargs):
        return Draw(kind, None, params_of(args, kwargs), kwargs.get("dtype"), shape=list(args[shape_at]))

    return spec


DRAWS = {
    aten.rand_like.default: lambda a, k: Draw("uniform", a[0], [0.0, 1.0], k.get("dtype")),
    aten.randn_like.default: lambda a, k: Draw("normal", a[0], [0.0, 1.0], k.get("dtype")),
    aten.randint_like.default: lambda a, k: Draw("random", a[0], [0, a[1]], k.get("dtype")),
    aten.randint_like.low_dtype: lambda a, k: Draw("random", a[0], [a[1], a[2]], k.get("dtype")),
    aten.bernoulli.default: lambda a, k: Draw("bernoulli_tensor", a[0], reads_values=True),
    aten.bernoulli.p: lambda a, k: Draw("bernoulli", a[0], [_arg(a, k, 1, "p", 0.5)]),
    aten.bernoulli_.float: _fill("bernoulli", [("p", 0.5)]),
    aten.bernoulli_.Tensor: lambda a, k: Draw("bernoulli_tensor", a[1], reads_values=True, into=a[0]),
    aten.exponential_.default: _fill("exponential", [("lambd", 1.0)]),
    aten.normal_.default: _fill("normal", [("mean", 0.0), ("std", 1.0)]),
    aten.uniform_.default: _fill("uniform", [("from", 0.0), ("to", 1.0)]),
    aten.cauchy_.default: _fill("cauchy", [("median", 0.0), ("sigma", 1.0)]),
    aten.log_normal_.default: _fill("log_normal", [("mean", 1.0), ("std", 2.0)]),
    aten.geometric_.default: _fill("geometric", [("p", None)]),
    aten.random_.default: _random_,
    aten.random_.to: _random_,
    getattr(aten.random_, "from"): _random_,
    aten.multinomial.default: lambda a, k: Draw(
        "multinomial", a[0], [a[1], bool(_arg(a, k, 2, "replacement", False))], reads_values=True
    ),
    aten.poisson.default: lambda a, k: Draw("poisson", a[0], reads_values=True),
    aten.randn.default: _created("normal", lambda a, k: [0.0, 1.0], 0),
    aten.rand.default: _created("uniform", lambda a, k: [0.0, 1.0], 0),
    aten.randint.default: _created("random", lambda a, k: [0, a[0]], 1),
    aten.randint.low: _created("random", lambda a, k: [a[0], a[1]], 2),
    aten.normal.float_float: _created("normal", lambda a, k: [a[0], a[1]], 2),
    aten.randperm.default: lambda a, k: Draw("randperm", None, [a[0]], k.get("dtype") or torch.int64, shape=[a[0]]),
}


FRESH = ("multinomial", "poisson", "randperm")  # outputs not laid out like an input (order: contiguous)


def _serial_order(em, node) -> list[int]:
    """How the serial model lays ``node``'s value out in memory (rng.serial_order): the order a
    draw into ``empty_like`` of it fills; only serial mode needs it (placement mode's draws are
    not the serial ones anyway)."""
    if _mode(em) != rng._SERIAL:
        return []
    return rng.serial_order(em.plan.traced, em.plan.model, node)


def _detached(graph, like):
    """The draw reads ``like``'s shape, dtype (and values) but no gradient flows through it."""
    return graph.call_function(aten.detach.default, (like,)) if isinstance(like, torch.fx.Node) else like


def _mode(em) -> int:
    return rng._SERIAL if em.plan.options.rng == "serial" else rng._PLACEMENT


def lower_random(em, node, args, kwargs):
    """A random op of the table as a draw by placement (see the module docstring)."""
    d = DRAWS[node.target](args, kwargs)
    g, state = em.graph, em.rank_value(rng.STATE)
    cuts = cuts_of(em, node)
    like = _detached(g, d.like)
    order = _serial_order(em, node) if d.like is not None and d.kind not in FRESH else []
    params = [float(p) for p in d.params]
    draw = g.call_function(
        torch.ops.autopar.random_draw.default,
        (state, like, d.shape, d.kind, params, d.dtype, cuts, _mode(em), d.reads_values, order),
    )
    if d.into is not None:
        return g.call_function(aten.copy_.default, (d.into, draw))
    return draw


def lower_normal(em, node, args, kwargs):
    """normal(mean, std) with a tensor among them: ATen draws N(0, 1) (N(0, std) for a float
    std) of the output's shape and scales it; so does the rank, on its draw."""
    mean, std = args[0], _arg(args, kwargs, 1, "std", 1.0)
    like = mean if isinstance(mean, torch.fx.Node) else std
    scale_std = isinstance(std, torch.fx.Node)
    params = [0.0, 1.0 if scale_std else float(std)]
    g = em.graph
    state = em.rank_value(rng.STATE)
    order = _serial_order(em, node)  # ATen's output layout (contiguous for most)
    draw = g.call_function(
        torch.ops.autopar.random_draw.default,
        (state, _detached(g, like), [], "normal", params, None, cuts_of(em, node), _mode(em), False, order),
    )
    if scale_std:  # torch gives normal() no gradient (zeros for mean and std): neither do we
        draw = g.call_function(aten.mul.Tensor, (draw, _detached(g, std)))
    return g.call_function(aten.add.Tensor, (draw, _detached(g, mean)))


def lower_feature_noise(em, node, args, kwargs):
    """Dropout2d/3d (feature_dropout), alpha_dropout, feature_alpha_dropout: train() follows the
    module; the noise's cuts are the tensor's on its batch and channel dims (feature) or all."""
    x, p = args[0], _arg(args, kwargs, 1, "p", 0.5)
    train = _arg(args, kwargs, 2, "train", True)
    if follows_mode(em, node, train):
        train = training(em)
    name = node.target.overloadpacket.__name__.rstrip("_")  # in-place forms alike
    feature, alpha = name.startswith("feature"), "alpha" in name
    cuts = cuts_of(em, node, dims=(0, 1) if feature else None)
    state, order = em.rank_value(rng.STATE), _serial_order(em, node.args[0])
    return em.graph.call_function(feature_noise, (x, p, train, state, cuts, _mode(em), alpha, feature, order))


def lower_sdpa(em, node, args, kwargs):
    """Attention with dropout_p > 0: its dropout on the attention weights drawn by placement
    (the weights are split like the output on batch and heads). dropout_p traced in training
    mode follows the module's train()/eval() (the model passed ``p if self.training else 0``)."""
    p = _arg(args, kwargs, 4, "dropout_p", 0.0)
    if not p:
        return None
    train = training(em) if em.plan.traced.training else False
    cuts = cuts_of(em, node, dims=(0, 1, 2))  # the weights (B, H, L, S) are split like the output (B, H, L, E)
    state = em.rank_value(rng.STATE)
    names = ("attn_mask", "dropout_p", "is_causal")
    rest = [_arg(args, kwargs, 3 + i, n, d) for i, (n, d) in enumerate(zip(names, (None, 0.0, False)))]
    extra = (kwargs.get("scale"), kwargs.get("enable_gqa", False))
    return em.graph.call_function(sdpa_with_dropout, (*args[:3], *rest, *extra, train, state, cuts, _mode(em)))


def lower_in_place(em, node, args, kwargs):
    """``dropout_`` and friends (``nn.Dropout(inplace=True)``): the out-of-place lowering's result
    copied into the input, as the serial op overwrites it."""
    out = OUT_OF_PLACE[node.target](em, node, args, kwargs)
    return em.graph.call_function(aten.copy_.default, (args[0], out))


def refuse(em, node, args, kwargs):
    raise ShardingError(
        f"{node.name} ({node.target}) draws random numbers, and autopar has no placement-following "
        "draw for it: every rank would draw its own, and replicas of one tensor would differ. "
        f"Supported: dropout, {', '.join(sorted(str(op) for op in DRAWS))}, normal, feature/alpha dropout, "
        "attention dropout. Replace it with one of those (e.g. torch.rand_like), or keep its module "
        "out of the model's traced part."
    )


RANDOM_LOWERINGS = dict.fromkeys(DRAWS, lower_random)
RANDOM_LOWERINGS.update(
    dict.fromkeys((aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor), lower_normal)
)
RANDOM_LOWERINGS.update(
    dict.fromkeys(
        (aten.feature_dropout.default, aten.alpha_dropout.default, aten.feature_alpha_dropout.default),
        lower_feature_noise,
    )
)
RANDOM_LOWERINGS[aten.scaled_dot_product_attention.default] = lower_sdpa
OUT_OF_PLACE = {
    aten.dropout_.default: lower_dropout,
    aten.feature_dropout_.default: lower_feature_noise,
    aten.alpha_dropout_.default: lower_feature_noise,
    aten.feature_alpha_dropout_.default: lower_feature_noise,
}
RANDOM_LOWERINGS.update(dict.fromkeys(OUT_OF_PLACE, lower_in_place))


def random_lowering(target):
    """The lowering of a random op (None for ops that draw nothing); an unknown random op is refused."""
    if target in RANDOM_LOWERINGS:
        return RANDOM_LOWERINGS[target]
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags and target is not aten.dropout.default:
        return refuse
    return None
