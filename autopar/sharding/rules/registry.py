"""The rule registry, and the small types rules speak in.

Everything autopar knows about one op is declared here, beside its rule: the rule (which
layouts it allows), its lowering (on the strategy it offers), and its *traits*: the work it
does (``Work``: what the cost model counts, never matched by the op's name), the argument that
holds a global shape (emission rewrites it to local sizes) and a *mode* lowering, run on every
strategy (the op follows the rank module's train/eval mode and the RNG contract; a view meets
a rank's strides).

Example:
    >>> @register(aten.relu.default)
    ... def relu_rule(op: OpInfo) -> list[Strategy]:
    ...     return elementwise_strategies(op)
    >>> register(aten.view.default, work=VIEW, shape_arg=1)(view_rule)
    >>> op_traits(aten.mm.default).work.kind
    'matmul'
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from autopar.placement import Placement, Replicate

R = Replicate()
# (shape, dtype, dynamic dims) per example tensor: a deep model's copied blocks share their
# example tensors, so each is read once (reading symbolic sizes is most of TensorMeta.of's cost)
# (keyed by id with a weak reference: tensors compare by value, not identity, in a WeakKeyDictionary)
_PARTS: dict[int, tuple] = {}


@dataclass(frozen=True, eq=False)  # identity hashing: two inputs of one shape are still two
class TensorMeta:
    """What a rule may know of a tensor: its example shape, which dims are dynamic, dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dynamic: tuple[bool, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @staticmethod
    def of(val) -> "TensorMeta":
        """A new TensorMeta for ``val`` (a new object each time: identity tells inputs apart)."""
        key = id(val)
        entry = _PARTS.get(key)
        if entry is None or entry[0]() is not val:
            entry = _PARTS[key] = (weakref.ref(val, lambda _, k=key: _PARTS.pop(k, None)), TensorMeta._parts(val))
        return TensorMeta(*entry[1])

    @staticmethod
    def _parts(val) -> tuple:
        shape, dyn = [], []
        for s in val.shape:
            if isinstance(s, torch.SymInt) and s.node.expr.is_number:  # specialised by export: static
                shape.append(int(s.node.expr))
                dyn.append(False)
            elif isinstance(s, torch.SymInt):
                shape.append(int(s.node.hint) if s.node.hint is not None else 2)
                dyn.append(True)
            else:
                shape.append(int(s))
                dyn.append(False)
        return tuple(shape), val.dtype, tuple(dyn)


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on one mesh axis.

    ``inputs[i]`` is the placement tensor input i must have (inputs in pytree-flatten order
    of the op's arguments); ``outputs[j]`` the placement output j then has. ``lowering`` is
    a local rewrite (``autopar.sharding.lowerings``) when running the op as-is on the local pieces is not
    enough (e.g. a vocab-parallel embedding masks out-of-range ids).
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    lowering: object = None  # a sharding.lowerings Lowering (its repr is its name)
    note: str = ""

    def __repr__(self) -> str:
        ins = ", ".join(map(repr, self.inputs))
        outs = ", ".join(map(repr, self.outputs))
        low = f" via {self.lowering}" if self.lowering else ""
        return f"[{ins}] -> [{outs}]{low}"


@dataclass
class OpInfo:
    """An op as a rule sees it: ``args``/``kwargs`` with tensors replaced by TensorMeta."""

    op: object
    args: tuple
    kwargs: dict
    tensors: list[TensorMeta]
    outputs: list[TensorMeta]
    arg_tensor_index: dict = field(default_factory=dict)  # id(TensorMeta in args) -> position

    def index(self, meta: TensorMeta) -> int:
        return self.arg_tensor_index[id(meta)]

    def arg(self, i: int, name: str, default=None):
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def strategy(self, placed: dict, outputs, lowering=None, note="") -> Strategy:
        """A Strategy from {TensorMeta: placement}; unnamed tensor inputs are replicated."""
        ins = [R] * len(self.tensors)
        for meta, p in placed.items():
            ins[self.index(meta)] = p
        outs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        return Strategy(tuple(ins), outs, lowering, note)

    def replicated(self) -> Strategy:
        return Strategy((R,) * len(self.tensors), (R,) * len(self.outputs), None, "replicated")


Rule = Callable[[OpInfo], list[Strategy]]
_RULES: dict[object, Rule] = {}


@dataclass(frozen=True)
class Work:
    """The work an op does, as the cost model counts it (cost/plan_cost.py): ``elementwise`` one
    FLOP per output element; ``view`` none, and its output shares its input's memory; ``matmul``
    2 M N K (``lhs_arg``: the argument whose last dim is contracted); ``attention`` 4 L S D per
    head (scaled dot-product attention's two matmuls). A kind the cost model does not know gives
    its own ``flops(node, sizes)``: the global forward FLOPs as a formula (a MoE experts module's
    grouped matmuls, kind ``experts``: parallel/experts/moe_rule.py); ``sizes`` is the cost
    model's symbols (``numel(shape)``, ``dim(size)``)."""

    kind: str
    lhs_arg: int = 0
    flops: Callable | None = None


ELEMENTWISE, VIEW, MATMUL, ATTENTION = Work("elementwise"), Work("view"), Work("matmul"), Work("attention")


@dataclass(frozen=True)
class OpTraits:
    """What an op is besides its rule (see the module docstring)."""

    work: Work = ELEMENTWISE
    shape_arg: int | None = None  # the argument holding a global shape (view's size)
    # (emitter, node, args, kwargs) -> node or None, on every strategy: the train/eval mode and RNG
    # (sharding/lowerings/train_modes.py), a view on other strides (sharding/lowerings/view_strides.py)
    mode: Callable | None = None


_TRAITS: dict[object, OpTraits] = {operator.getitem: OpTraits(work=VIEW)}  # an item of a multi-output op
_DEFAULT_TRAITS = OpTraits()


def declare(*ops, **traits) -> None:
    """Give ops their traits (``work``, ``shape_arg``, ``mode``); a trait declared twice for one op
    is an error (two files disagreeing about one op).

    Example:
        >>> declare(*aten_ops("permute", "t"), work=VIEW)
    """
    unknown = set(traits) - {f for f in OpTraits.__dataclass_fields__}
    if unknown:
        raise TypeError(f"declare: unknown traits {sorted(unknown)}; traits are work, shape_arg, mode")
    for op in ops:
        old = _TRAITS.get(op, _DEFAULT_TRAITS)
        for key, value in traits.items():
            if getattr(old, key) != getattr(_DEFAULT_TRAITS, key) and getattr(old, key) != value:
                raise ValueError(f"declare: {op} already has {key}={getattr(old, key)!r}; not {value!r}")
        _TRAITS[op] = OpTraits(**{**old.__dict__, **traits})


def op_traits(op) -> OpTraits:
    """The traits of ``op`` (a graph node's target); the defaults for an op nobody declared."""
    return _TRAITS.get(op, _DEFAULT_TRAITS)


def aten_ops(*names: str) -> tuple:
    """ATen overloads by name: ``"relu"`` is ``aten.relu.default``, ``"max.other"`` that overload.

    Rules are registered per overload because one packet mixes meanings: ``max.other`` is
    elementwise, ``max.dim`` a reduction, ``max.default`` a full reduction.
    """
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        out.append(getattr(getattr(torch.ops.aten, packet), overload or "default"))
    return tuple(out)


def functional_overloads(*packets: str) -> tuple:
    """Every overload but the ``out=`` variants of the ATen packets named (those this torch lacks
    skipped): for op families whose overloads all mean the same (pooling over 2 dims, ...).

    Example:
        >>> register(*functional_overloads("max_pool2d", "max_pool2d_with_indices"))(pool_rule)
    """
    out = []
    for name in packets:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            out += [getattr(packet, o) for o in packet.overloads() if "out" not in o]
    return tuple(out)


def register(*ops, **traits):
    """Register a rule for ATen OpOverloads (never whole packets; each op at most once), with the
    ops' traits if given (``declare``).

    Example:
        >>> register(*aten_ops("relu", "max.other"))(elementwise_rule)
        >>> register(*aten_ops("mm", "bmm"), work=MATMUL)(matmul_rule)
    """
    for op in ops:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(
                f"register({op!r}): register single overloads (e.g. {op!r}.default), "
                "not a whole overload packet: its overloads may mean different things."
            )

    def deco(fn: Rule) -> Rule:
        for op in ops:
            if op in _RULES:
                raise ValueError(
                    f"register: {op} already has the rule {_RULES[op].__name__!r}; "
                    f"a second one ({fn.__name__!r}) would silently replace it. Extend "
                    "the existing rule instead."
                )
        for op in ops:
            _RULES[op] = fn
        if traits:
            declare(*ops, **traits)
        return fn

    return deco


# rules for ops of other libraries (``"transformers::grouped_mm_fallback"``), by qualified name:
# their OpOverload exists only once that library is imported, which autopar must not force
_BY_NAME: dict[str, Rule] = {}


def register_by_name(*names: str):
    """Register a rule for custom ops named ``"namespace::op"`` (their default overload).

    Example:
        >>> register_by_name("transformers::grouped_mm_fallback")(grouped_mm_rule)
    """

    def deco(fn: Rule) -> Rule:
        for name in names:
            if name in _BY_NAME:
                raise ValueError(f"register_by_name: {name} already has the rule {_BY_NAME[name].__name__!r}")
            _BY_NAME[name] = fn
        return fn

    return deco


def get_rule(op) -> Rule | None:
    rule = _RULES.get(op)
    if rule is None and _BY_NAME and isinstance(op, torch._ops.OpOverload) and op._overloadname == "default":
        rule = _BY_NAME.get(op.name())
    return rule


def registered_ops() -> list:
    return list(_RULES)
