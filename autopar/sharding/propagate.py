"""Complete a layout for every node from the seeds, choosing one strategy per op and axis.

A pass over the graph in order (an fx pass writing ``node.meta["autopar"]``). Placeholders
take their seeded layouts (replicated when not annotated). For each op the rule's
strategies are costed on each mesh axis: bytes of the redistributions its inputs would
need (forward and backward), plus what a module-output annotation would cost after it;
communication on parameters is weighed heavily, since it is rarely what an annotation
meant. The cheapest valid strategy wins; ties go to the fewest redistributions, then to the
rule's order. An op without a rule runs replicated when nothing reaching it is split; when
something is, its inputs are gathered (with a warning) or, with ``strict=True``, NoRuleError.

Example:
    >>> ctx = propagate(traced, mesh, seeds)
    >>> layout_of(node).spec
    (R, S(2))
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.sharding.blocked_shards import with_blocks
from autopar.sharding.data_dependent import data_dependent_error, is_data_dependent_error
from autopar.errors import NoRuleError, ShardingError
from autopar.placement import Partial, Placement, Replicate, Shard, check_layout, fmt_spec
from autopar.sharding.redistribute import plan_steps, steps_cost
from autopar.sharding.rules import OpInfo, Strategy, TensorMeta, get_rule
from autopar.trace.module_paths import module_path, module_paths

aten = torch.ops.aten
R = Replicate()
PARAM_COMM_WEIGHT = 16.0  # moving a parameter is rarely what the user meant
# moving a parameter the annotations split is never what the user meant: an annotated layer
# computes in the layout its annotation gives it (as parallelize_module's styles do), so a
# strategy that needs its parameter elsewhere is taken only where no other applies
ANNOTATED_MOVE = 1e15

BOUNDARY = "autopar_boundary"  # node.meta mark of the aliases that hold a module's output layout


@dataclass
class Layout:
    """What propagation decided for one node (kept in node.meta["autopar"])."""

    outputs: list[tuple[Placement, ...]]  # placements per tensor output; [] for scalars
    inputs: list[fx.Node] = field(default_factory=list)  # tensor inputs, flatten order
    input_targets: list[tuple[Placement, ...]] = field(default_factory=list)  # placements each needs
    strategies: tuple[Strategy | None, ...] = ()  # one per mesh axis
    reason: str = ""
    alternatives: list[tuple[int, str, float]] = field(default_factory=list)  # (axis, strategy, cost)
    fallback: bool = False

    @property
    def spec(self) -> tuple[Placement, ...] | None:
        return self.outputs[0] if self.outputs else None


def layout_of(node: fx.Node) -> Layout:
    return node.meta["autopar"]


def is_tensor(val) -> bool:
    return isinstance(val, torch.Tensor)


def tensor_outputs(node: fx.Node) -> list:
    val = node.meta.get("val")
    if is_tensor(val):
        return [val]
    if isinstance(val, (list, tuple)) and val and all(is_tensor(v) or v is None for v in val):
        return [v for v in val]
    return []


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments in argument order, a repeated one as often as it appears."""
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a) if is_tensor(a.meta.get("val")) else None)
    return out


def op_info(node: fx.Node) -> OpInfo:
    metas: list[TensorMeta] = []
    index = {}

    def conv(a):
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if is_tensor(val):
                m = TensorMeta.of(val)
                index[id(m)] = len(metas)
                metas.append(m)
                return m
            return _scalar_hint(val)
        return a

    args, kwargs = _map_leaves((node.args, node.kwargs), conv)
    outs = [TensorMeta.of(v) for v in tensor_outputs(node) if v is not None]
    return OpInfo(node.target, tuple(args), dict(kwargs), metas, outs, index)


def _map_leaves(a, fn):
    """fn over the leaves of nested tuples, lists and dicts (the containers of fx arguments).

    Why not pytree.tree_map: propagation calls this for every node, and pytree's generic
    walk (namedtuples, registered types) was a fifth of its time.
    """
    if isinstance(a, tuple):
        return tuple(_map_leaves(x, fn) for x in a)
    if isinstance(a, list):
        return [_map_leaves(x, fn) for x in a]
    if isinstance(a, dict):
        return {k: _map_leaves(v, fn) for k, v in a.items()}
    return fn(a)


def _scalar_hint(val):
    if isinstance(val, torch.SymInt):
        return int(val.node.hint) if val.node.hint is not None else val
    return val


@dataclass
class Context:
    mesh: object
    seeds: object
    strict: bool
    param_nodes: set
    needs_grad: dict  # node -> bool
    param_derived: dict  # node -> bool
    output_constraints: dict  # node -> {axis: Placement}
    warned: set = field(default_factory=set)
    choices: dict | None = field(default_factory=dict)  # choice cache (see _choice_key); None: off
    ragged: frozenset = frozenset()  # axes on which dynamic split dims may be cut unevenly (is_ragged)
    annotated: set = field(default_factory=set)  # parameter nodes an annotation splits


def propagate(traced, mesh, seeds, strict: bool = False, cache: bool = True, pinned: dict | None = None) -> Context:
    """Fill node.meta["autopar"] for every node of ``traced.gm``; return what was learnt on the way.

    ``cache=False`` re-solves every op from scratch (the cache never changes a result: see
    _choice_key; tests compare both). ``pinned``: node -> {axis: placement} its output must leave
    in, as a module output constraint (sharding/written_views.py: a tensor written in place
    through a view).
    """
    graph = traced.gm.graph
    _forget_previous_plan(graph)
    constraints = _module_output_nodes(graph, seeds)
    for node, wanted in (pinned or {}).items():
        constraints.setdefault(node, {}).update(wanted)
    ctx = Context(mesh, seeds, strict, set(), {}, {}, constraints)
    phs = [n for n in graph.nodes if n.op == "placeholder" and n.name in traced.user_inputs]
    ctx.ragged = is_ragged([(n.meta.get("val"), seeds.inputs.get(n.name)) for n in phs], mesh)
    ctx.choices = _kept_choices(traced.gm, ctx) if cache else None
    for node in graph.nodes:
        if node.meta.get(BOUNDARY):
            continue  # inserted just now by _enforce_output_constraint, with its layout
        if node.op == "placeholder":
            layout = _placeholder_layout(node, traced, ctx)
        elif node.op == "get_attr":
            layout = Layout([(R,) * mesh.ndim], reason="constant")
            ctx.param_derived[node], ctx.needs_grad[node] = True, False
        elif node.op == "call_function":
            try:
                layout = _call_layout(node, ctx)
            except Exception as e:  # noqa: BLE001 - only torch's data-dependent guard is rewritten
                if not is_data_dependent_error(e):
                    raise
                raise data_dependent_error(node, e, module_path(node)) from None
        else:
            continue
        node.meta["autopar"] = layout
        if node in ctx.output_constraints and layout.outputs:
            _enforce_output_constraint(node, ctx)
    hoist_slices(graph, ctx)
    check_layouts(graph, mesh)
    return ctx


def hoist_slices(graph: fx.Graph, ctx: Context) -> int:
    """Split early what every consumer slices anyway; return how many (node, axis) choices changed.

    Why: the forward pass chooses greedily, and between keeping a tensor replicated and splitting
    it by a free local slice it sees a tie (no bytes move either way) and keeps it replicated; the
    consumers then slice it. HF LLaMA's causal mask is built from an ``arange`` at the global
    batch, so it stayed a (batch, 1, seq, seq) bool on every rank (16 GiB per rank for 256 x 8192
    rows) while attention read 1/dp of it. Here, walking back from the outputs, a node whose every
    consumer reads it as the same ``Shard(d)`` on an axis where it is replicated takes the rule's
    strategy that gives ``Shard(d)`` there, when that strategy reaches its own inputs by local
    slices alone: no communication is added, fewer bytes are held per rank, and the slices move
    up to the producers (which are then considered in turn).

    Only tensors no gradient flows through (masks, indices, positions): the backward of a slice
    of a tensor that needs a gradient gathers. And a broadcast of parameters alone (gpt-oss's
    attention sinks expanded to the global batch, read batch-split): its replicated inputs
    stay as they are (no slice), so its gradient arrives in parts and reaches the parameters as
    a partial sum that the gradient sync reduces once, instead of an all-gather of the
    (batch-sized) gradient at every consumer. Not on axes where the batch is cut unevenly, nor
    for placeholders, in-place ops, multi-output ops or module-output boundaries.

    Example (a causal mask on a dp=4 mesh): ``and_2`` (8, 1, 32, 32) was (R,), every attention
    reads it S(0): it becomes (S(0),), its inputs are sliced instead, and so on up to ``arange``.
    """
    changed = 0
    mesh = ctx.mesh
    for node in reversed(graph.nodes):
        lay = node.meta.get("autopar")
        if (
            node.op != "call_function"
            or lay is None
            or len(lay.outputs) != 1
            or len(lay.strategies) != mesh.ndim
            or any(s is None for s in lay.strategies)
            or node.meta.get(BOUNDARY)
            or node in ctx.output_constraints
            or (ctx.needs_grad.get(node) and not _broadcasts_parameters(node, lay, ctx))
            or _mutates_first(node)
            or not is_tensor(node.meta.get("val"))
        ):
            continue
        for axis in range(mesh.ndim):
            if axis in ctx.ragged or not lay.outputs[0][axis].is_replicate():
                continue
            wanted = _read_as(node, axis)
            if wanted is not None and _split_output(node, lay, axis, wanted, ctx):
                changed += 1
    return changed


def _broadcasts_parameters(node: fx.Node, lay: Layout, ctx: Context) -> bool:
    """``node`` is computed from parameters alone (or what needs no gradient) and is no smaller
    than its inputs together (an expand): its gradient may stay in parts back to them."""
    val = node.meta.get("val")
    ins = [i.meta.get("val") for i in lay.inputs]
    if not all(is_tensor(v) for v in [val, *ins]):
        return False
    return bool(ctx.param_derived.get(node)) and val.numel() >= sum(v.numel() for v in ins)


def _read_as(node: fx.Node, axis: int):
    """The one Shard every consumer reads ``node`` as on ``axis``, or None."""
    seen = set()
    for user in node.users:
        ulay = user.meta.get("autopar")
        if ulay is None:
            return None  # the graph's output, or a node propagation skipped
        if not ulay.outputs and not ulay.input_targets:
            continue  # an assertion (_assert_tensor_metadata): reads nothing it needs placed
        hits = [t[axis] for i, t in zip(ulay.inputs, ulay.input_targets) if i is node]
        if not hits:
            return None
        seen.update(hits)
    if len(seen) != 1:
        return None
    (p,) = seen
    return p if isinstance(p, Shard) and p.blocks == 1 else None


def _split_output(node: fx.Node, lay: Layout, axis: int, wanted: Shard, ctx: Context) -> bool:
    rule = get_rule(node.target)
    if rule is None:
        return False
    info = op_info(node)
    cur = [_current(i) for i in lay.inputs]
    if len(cur) != len(info.tensors) or any(c is None for c in cur):
        return False
    offered = rule(info)
    if offered is None:
        return False
    others = [s for a, s in enumerate(lay.strategies) if a != axis]
    for s in with_blocks(offered, info, cur):
        if s.outputs[:1] != (wanted,) or not _valid(s, axis, info, others, ctx.mesh):
            continue
        if ctx.needs_grad.get(node):  # inputs kept as they are: a slice's backward would gather
            if all(c[axis] == t for c, t in zip(cur, s.inputs)):
                break
        elif all(not st.communicates for c, t in zip(cur, s.inputs) for st in plan_steps((c[axis],), (t,))):
            break
    else:
        return False
    lay.outputs[0] = tuple(wanted if a == axis else p for a, p in enumerate(lay.outputs[0]))
    lay.input_targets = [
        tuple(s.inputs[i] if a == axis else p for a, p in enumerate(t)) for i, t in enumerate(lay.input_targets)
    ]
    lay.strategies = tuple(s if a == axis else c for a, c in enumerate(lay.strategies))
    lay.reason += f"; {ctx.mesh.axis_names[axis]}: split as its consumers read it: {s!r}"
    return True


def is_ragged(inputs, mesh) -> frozenset:
    """The mesh axes on which a plan's dynamic split dims may be cut unevenly at run time: those
    where some user input (``(example value, placements)`` pairs) has a dim sized at run time (the
    batch) that its example cuts unevenly (a batch of 6 on dp=4: 2, 2, 1, 1).

    Why from the example: a plan traced with a batch that divides keeps the faster even forms
    (a mean over the batch as Partial("avg") with no weighting), and its input guard refuses a
    batch that does not divide, saying to plan with one that does not; a plan traced with an
    uneven batch takes any batch size.
    """
    axes = set()
    for val, placements in inputs:
        if not is_tensor(val) or not placements:
            continue
        meta = TensorMeta.of(val)
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim < meta.ndim and meta.dynamic[p.dim]:
                if meta.shape[p.dim] % mesh.shape[axis]:
                    axes.add(axis)
    return frozenset(axes)


def _forget_previous_plan(graph: fx.Graph) -> None:
    """A traced graph may be planned again (another mesh, other annotations): drop the boundary
    nodes and layouts an earlier propagation left, so that nothing stale survives."""
    for node in list(graph.nodes):
        if node.meta.get(BOUNDARY):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in graph.nodes:
        node.meta.pop("autopar", None)


def _enforce_output_constraint(node: fx.Node, ctx: Context) -> None:
    """Make a module's output leave in its annotated layout (e.g. a row-parallel layer's R).

    Why a node: the constraint is where the reduction belongs (Megatron's "g" right after
    the layer); left to the consumers, a Partial would leak into the residual stream and
    every later op would pick its own, costlier, place to reduce. An ``aten.alias`` is
    inserted after the node; its input edge carries the redistribution and every other
    user reads the alias.
    """
    spec = list(layout_of(node).spec)
    wanted = dict(ctx.output_constraints[node])
    if not is_tensor(node.meta.get("val")) or all(spec[a] == p for a, p in wanted.items()):
        return
    target = tuple(wanted.get(a, p) for a, p in enumerate(spec))
    users = [u for u in node.users]
    with node.graph.inserting_after(node):
        boundary = node.graph.call_function(aten.alias.default, (node,))
    boundary.meta = {k: v for k, v in node.meta.items() if k != "autopar"}
    boundary.meta[BOUNDARY] = True
    for u in users:
        u.replace_input_with(node, boundary)
    boundary.meta["autopar"] = Layout(
        [target], [node], [target], (None,) * ctx.mesh.ndim, reason=f"module output constraint {fmt_spec(target)}"
    )
    ctx.param_derived[boundary] = ctx.param_derived.get(node, False)
    ctx.needs_grad[boundary] = ctx.needs_grad.get(node, False)


def _module_output_nodes(graph: fx.Graph, seeds) -> dict:
    """Nodes whose value leaves an annotated module: they must end in the annotated layout."""
    out = {}
    if not seeds.module_outputs:
        return out
    members: dict[str, set] = {path: set() for path in seeds.module_outputs}
    for node in graph.nodes:
        for path in module_paths(node):
            if path in members:
                members[path].add(node)
    for path, nodes in members.items():
        for node in nodes:
            if any(u not in nodes for u in node.users) and is_tensor(node.meta.get("val")):
                out.setdefault(node, {}).update(seeds.module_outputs[path])
    return out


def _placeholder_layout(node, traced, ctx) -> Layout:
    mesh, seeds = ctx.mesh, ctx.seeds
    default = (R,) * mesh.ndim
    if node.name in traced.param_fqn:
        fqn = traced.param_fqn[node.name]
        placements = seeds.params.get(fqn, default)
        reason = seeds.reasons.get(fqn, "parameter, replicated (no annotation)")
        ctx.param_nodes.add(node)
        if any(not p.is_replicate() for p in placements):
            ctx.annotated.add(node)
        ctx.param_derived[node] = True
        ctx.needs_grad[node] = bool(getattr(node.meta.get("val"), "requires_grad", True))
    elif node.name in traced.buffer_fqn or node.name in traced.constant_fqn:
        fqn = traced.buffer_fqn.get(node.name) or traced.constant_fqn[node.name]
        placements = seeds.params.get(fqn, default)
        reason = seeds.reasons.get(fqn, "buffer, replicated")
        ctx.param_derived[node], ctx.needs_grad[node] = True, False
    else:
        placements = seeds.inputs.get(node.name, default)
        reason = seeds.reasons.get(node.name, "input, replicated")
        # an input the example passes with requires_grad gets its gradient whole, as a parameter
        # does (inputs_embeds, soft prompts): its replicated uses by split compute need "f"
        ctx.param_derived[node], ctx.needs_grad[node] = False, input_requires_grad(node)
    val = node.meta.get("val")
    if not is_tensor(val):
        return Layout([], reason="non-tensor input")
    meta = TensorMeta.of(val)
    what = f"input {node.name!r}" if node.name in traced.user_inputs else f"{node.name!r}"
    check_layout(meta.shape, placements, mesh, what)
    return Layout([tuple(placements)], reason=reason)


def input_requires_grad(node: fx.Node) -> bool:
    """Does this user-input placeholder's example require a gradient (a floating tensor with
    requires_grad)? The plan's gradient flow is made for it; the input guard refuses one that
    requires grad at run time when its example did not."""
    val = node.meta.get("val")
    return is_tensor(val) and val.dtype.is_floating_point and bool(val.requires_grad)


def _call_layout(node: fx.Node, ctx: Context) -> Layout:
    ins = tensor_inputs(node)
    if node.target is operator.getitem:  # its source holds a list, not a tensor: follow it anyway
        ins = [node.args[0]]
    ctx.param_derived[node] = all(ctx.param_derived.get(i, False) for i in ins)
    outs = tensor_outputs(node)
    floating = any(v is not None and v.dtype.is_floating_point for v in outs)
    ctx.needs_grad[node] = floating and any(ctx.needs_grad.get(i, False) for i in ins)
    if node.target is operator.getitem:
        src = layout_of(node.args[0])
        idx = node.args[1]
        if src.outputs and isinstance(idx, int) and idx < len(src.outputs):
            return Layout([src.outputs[idx]], [node.args[0]], reason="item of a multi-output op")
        return Layout([], reason="non-tensor item")
    if not outs:
        return Layout([], inputs=ins, reason="scalar or assertion")
    return choose(node, ins, ctx)


def _current(node: fx.Node) -> tuple[Placement, ...]:
    return layout_of(node).spec


def choose(node: fx.Node, ins: list[fx.Node], ctx: Context) -> Layout:
    info = op_info(node)
    cur = [_current(i) for i in ins]
    rule = get_rule(node.target)
    if rule is None:
        return _no_rule(node, ins, info, cur, ctx)
    key = _choice_key(node, ins, info, cur, rule, ctx) if ctx.choices is not None else None
    hit = ctx.choices.get(key) if key is not None else None
    if hit is None:
        hit = _solve(node, ins, info, cur, rule, ctx)
        if hit is None:  # the rule does not apply to these arguments: as an op without a rule
            return _no_rule(node, ins, info, cur, ctx)
        if key is not None:
            ctx.choices[key] = hit
    outputs, targets, chosen, reason, alternatives = hit
    return Layout(list(outputs), list(ins), list(targets), chosen, reason, list(alternatives))


CHOICES = "autopar_choices"  # gm.meta: the choice cache of each earlier propagation of the graph


def _kept_choices(gm, ctx: Context) -> dict:
    """The choice cache for propagating ``gm`` under ``ctx``: shared by every propagation of the
    same graph on the same mesh with the same ragged axes and piece multiples (what _solve reads
    besides the key), so that the search's probes, which plan one graph under many annotations,
    solve an op once for all of them (propagation was a third of a 512-rank search)."""
    mesh = ctx.mesh
    where = (mesh.shape, mesh.axis_names, frozenset(ctx.ragged), tuple(sorted(ctx.seeds.piece_multiple.items())))
    return gm.meta.setdefault(CHOICES, {}).setdefault(where, {})


def _choice_key(node, ins, info: OpInfo, cur, rule, ctx: Context):
    """Everything _solve reads, as a hashable key; None when something is not hashable.

    Why: a model of N identical blocks has N copies of each op with the same shapes, the same
    input layouts and the same gradient facts; solving each once makes propagation time grow
    with the number of *distinct* ops, not with depth. The key holds the op, its arguments
    with every tensor replaced by (shape, dtype, dynamic dims), the output metas, the current
    placements of the inputs, per input whether it is a parameter / needs a gradient / is
    computed from parameters alone, the node's module-output constraint, and the rule itself
    (the cache outlives one propagation: _kept_choices; a rule registered again must not meet
    its predecessor's answers): exactly what the rule (a pure function of OpInfo) and _cost
    look at. The mesh, the ragged axes and the piece multiples are _kept_choices' key.
    """

    def freeze(a):
        if isinstance(a, TensorMeta):
            return ("T", a.shape, a.dtype, a.dynamic)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(freeze, a))
        if isinstance(a, dict):
            return ("dict", *sorted((k, freeze(v)) for k, v in a.items()))
        if isinstance(a, torch.SymInt):
            raise TypeError("symbolic size without a hint")
        return (type(a).__name__, a)

    try:
        key = (
            node.target,
            rule,
            freeze(info.args),
            freeze(info.kwargs),
            freeze(info.outputs),
            tuple(cur),
            tuple(
                (i in ctx.param_nodes, i in ctx.annotated, bool(ctx.needs_grad.get(i)), bool(ctx.param_derived.get(i)))
                for i in ins
            ),
            tuple(sorted(ctx.output_constraints.get(node, {}).items())),
        )
        hash(key)
    except TypeError:
        return None
    return key


def _solve(node, ins, info: OpInfo, cur, rule, ctx: Context) -> tuple:
    """Cost the rule's strategies on each axis; (outputs, input targets, chosen, reason, alternatives),
    or None when the rule answers None (it does not apply to these arguments)."""
    mesh = ctx.mesh
    offered = rule(info)
    if offered is None:
        return None
    strategies = with_blocks(offered, info, cur)
    chosen: list[Strategy] = []
    alternatives = []
    in_place = _mutates_first(node)
    for axis in range(mesh.ndim):
        scored = []
        keeps = [s for s in strategies if s.inputs[:1] == (cur[0][axis],)] if in_place else []
        for idx, s in enumerate(strategies):
            if not _valid(s, axis, info, chosen, mesh, axis in ctx.ragged, ctx.seeds.piece_multiple.get(axis, 1)):
                continue
            if keeps and s.inputs[:1] != (cur[0][axis],):
                continue  # an in-place op writes into its first input: redistributing it would write a copy
            scored.append((_cost(node, s, axis, ins, info, cur, ctx), idx, s))
        scored.sort(key=lambda t: (t[0], t[1]))
        best = scored[0][2]
        chosen.append(best)
        alternatives += [(axis, repr(s), c[0]) for c, _, s in scored[:4]]
    outputs = [tuple(chosen[a].outputs[j] for a in range(mesh.ndim)) for j in range(len(info.outputs))]
    targets = [tuple(chosen[a].inputs[i] for a in range(mesh.ndim)) for i in range(len(ins))]
    reason = f"rule {rule.__name__}: " + "; ".join(
        f"{mesh.axis_names[a]}: {chosen[a]!r}" + (f" ({chosen[a].note})" if chosen[a].note else "")
        for a in range(mesh.ndim)
    )
    return tuple(outputs), tuple(targets), tuple(chosen), reason, tuple(alternatives)


def _mutates_first(node) -> bool:
    """The op writes into its first argument (copy_, index_put_, scatter_, add_, ...): often a view
    of another tensor (``key[..., :8].copy_(k)``) whose base the write must reach."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _valid(
    s: Strategy, axis: int, info: OpInfo, chosen: list[Strategy], mesh, ragged: bool = False, multiple: int = 1
) -> bool:
    """May ``s`` run on ``axis``? ``ragged``: dynamic dims split on it may be cut unevenly (is_ragged);
    ``multiple`` > 1: every split dim must cut into multiple x n equal chunks (Seeds.piece_multiple)."""
    n = mesh.shape[axis]
    split_sizes, uneven, rows = set(), False, False
    for metas, places, prior in (
        (info.tensors, s.inputs, [c.inputs for c in chosen]),
        (info.outputs, s.outputs, [c.outputs for c in chosen]),
    ):
        for k, (meta, p) in enumerate(zip(metas, places)):
            if not isinstance(p, Shard):
                continue
            if p.dim >= meta.ndim:
                return False
            if p.grouped and (n % p.grouped or n == p.grouped):
                return False  # split on a part (Shard.within / across) that does not cut this axis
            if p.of is not None:  # an item of a split list (an expert's weight): whole or empty by construction
                continue
            size, pieces = meta.shape[p.dim], p.pieces(n)  # a split on a part of the axis: that part's pieces
            # a dynamic dim (the batch) must divide at the example's sizes: its pieces are sized
            # at run time by the input guard; a blocked shard must divide in every block
            dynamic = p.dim < len(meta.dynamic) and meta.dynamic[p.dim]
            if ((dynamic and not ragged) or p.blocks > 1) and size % (pieces * p.blocks):
                return False
            if multiple > 1 and size % (pieces * p.blocks * multiple):
                return False
            if any(isinstance(pl[k], Shard) and pl[k].dim == p.dim and pl[k].of is None for pl in prior):
                return False  # that dim is already split by an earlier axis (an item of a list's is whole or empty)
            if dynamic and ragged:  # pieces of any size, whose rows stay in order: no size to match
                rows = True
                continue
            split_sizes.add(size)
            uneven = uneven or size % pieces != 0
    return not (uneven or rows) or _uneven_ok(s, split_sizes, rows_only=not uneven)


def _uneven_ok(s: Strategy, split_sizes: set, rows_only: bool = False) -> bool:
    """May ``s`` run on pieces of different sizes (a split dim that does not divide)?

    Why this test: a strategy made for even splits pairs row i of a split input dim with row i
    of the split output dim. With uneven pieces that pairing holds only when every split dim
    has the same size (the same ``tensor_split`` cuts them all): a view that merges a split dim
    with others, ``(6, 11) -> (66,)``, does not (6 on 4 ranks is 2,2,1,1 rows; 66 is 17,17,16,16).
    A mean over a split dim (Partial("avg")) is weighted by each rank's share of the rows at
    emission (Emitter._weigh_averages; one tensor output only), and a lowering must say that it
    sizes its pieces (``Lowering.uneven``); where only dynamic dims on a ragged axis are uneven
    (``rows_only``), a lowering that sizes everything from its own pieces will do (``Lowering.ragged``).
    """
    if len(split_sizes) > 1:
        return False
    if len(s.outputs) > 1 and any(isinstance(p, Partial) and p.reduce_op == "avg" for p in s.outputs):
        return False
    return s.lowering is None or getattr(s.lowering, "uneven", False) or (rows_only and s.lowering.ragged)


def _cost(node, s: Strategy, axis: int, ins, info: OpInfo, cur, ctx: Context) -> tuple:
    mesh = ctx.mesh
    total, comm_steps, local_steps = 0.0, 0, 0
    out_split = any(not p.is_replicate() for p in s.outputs)
    for i, (inp, meta) in enumerate(zip(ins, info.tensors)):
        src = cur[i][axis]
        nbytes = _bytes(meta) / _others_factor(cur[i], mesh, axis)
        if src != s.inputs[i] and _within(src, s.inputs[i]):
            total += RAGGED_MOVE  # split within groups: no collective moves it (its op's strategy keeps it)
            continue
        if src != s.inputs[i]:
            steps = _steps_between(src, s.inputs[i])
            fwd, bwd = steps_cost(steps, (src,), _OneAxis(mesh.shape[axis]), nbytes)
            weight = ANNOTATED_MOVE if inp in ctx.annotated else PARAM_COMM_WEIGHT if inp in ctx.param_nodes else 1.0
            total += (fwd + (bwd if ctx.needs_grad.get(inp) else 0.0)) * weight
            if axis in ctx.ragged and _moves_dynamic(steps, meta):
                total += RAGGED_MOVE  # a batch cut unevenly cannot move (sharding/ragged.py): any other way
            comm_steps += sum(st.communicates for st in steps)
            local_steps += sum(not st.communicates for st in steps)
        needs_f = (
            s.inputs[i].is_replicate()
            and out_split
            and ctx.needs_grad.get(inp)
            and (src != s.inputs[i] or not ctx.param_derived.get(inp))
        )
        if needs_f:  # Megatron's "f": an all-reduce of the gradient (see gradflow.py)
            n = mesh.shape[axis]
            total += 2 * (n - 1) / n * nbytes
    if s.lowering is not None:  # a collective the lowering runs itself (float8's fp8 gathers)
        total += s.lowering.strategy_bytes(info, s, axis, cur, mesh, [bool(ctx.needs_grad.get(i)) for i in ins])
    wanted = ctx.output_constraints.get(node, {}).get(axis)
    if wanted is not None and s.outputs[0] != wanted:
        meta = info.outputs[0]
        steps = _steps_between(s.outputs[0], wanted)
        fwd, bwd = steps_cost(steps, (s.outputs[0],), _OneAxis(mesh.shape[axis]), _bytes(meta))
        total += fwd + bwd
        comm_steps += sum(st.communicates for st in steps)
        local_steps += len(steps)
    return (round(total, 3), comm_steps, local_steps)


RAGGED_MOVE = 1e18  # the cost of moving a dim a ragged axis cuts: refused at planning if chosen


_STEPS: dict = {}  # (placement, placement) -> plan_steps between them on one axis


def _steps_between(src: Placement, dst: Placement) -> tuple:
    """plan_steps from ``src`` to ``dst`` on one axis, worked out once per pair: _cost asks it for
    every strategy of every op solved (28,000 times in a 512-rank search, of a few dozen pairs).
    A pair plan_steps refuses raises each time (it is not kept)."""
    key = (src, dst)
    got = _STEPS.get(key)
    if got is None:
        got = _STEPS[key] = tuple(plan_steps((src,), (dst,)))
    return got


def _within(*placements) -> bool:
    """Whether any of ``placements`` is split on a part of its axis (Shard.within / across)."""
    return any(isinstance(p, Shard) and p.grouped for p in placements)


def _moves_dynamic(steps, meta: TensorMeta) -> bool:
    """Whether ``steps`` move a dim of ``meta`` sized at run time (gather, slice, regroup)."""
    dims = [d for st in steps for d in (st.dim, st.dim2) if d is not None and st.kind != "partial_cast"]
    return any(d < len(meta.dynamic) and meta.dynamic[d] for d in dims)


class _OneAxis:
    def __init__(self, n):
        self.shape = (n,)


def _bytes(meta: TensorMeta) -> float:
    n = 1
    for s in meta.shape:
        n *= s
    return float(n * meta.dtype.itemsize)


def _others_factor(placements, mesh, axis) -> int:
    f = 1
    for a, p in enumerate(placements):
        if a != axis and isinstance(p, Shard):
            f *= mesh.shape[a]
    return f


def _no_rule(node, ins, info, cur, ctx) -> Layout:
    mesh = ctx.mesh
    replicated = (R,) * mesh.ndim
    split = [i for i, c in zip(ins, cur) if c != replicated]
    where = f"node {node.name!r} (module {module_path(node) or '<top>'!r})"
    if split and ctx.strict:
        raise NoRuleError(
            f"No sharding rule for {node.target} at {where}, and its input(s) "
            f"{', '.join(f'{i.name} {fmt_spec(_current(i))}' for i in split)} are split. "
            "Annotate so that this op sees replicated inputs, add a rule with "
            "autopar.sharding.rules.register, or pass strict=False to gather the inputs and run it replicated."
        )
    if split and node.target not in ctx.warned:
        ctx.warned.add(node.target)
        fwd = bwd = 0.0
        for i, c, meta in zip(ins, cur, info.tensors):
            if c != replicated:
                f, b = steps_cost(plan_steps(c, replicated), c, mesh, _bytes(meta))
                fwd, bwd = fwd + f, bwd + (b if ctx.needs_grad.get(i) else 0.0)
        warnings.warn(
            f"autopar: no sharding rule for {node.target} at {where}: its inputs "
            f"{', '.join(f'{i.name} {fmt_spec(_current(i))}' for i in split)} are gathered "
            f"and it runs replicated on every rank (correct, but it costs {fwd:.0f} bytes "
            f"of communication per rank forward, {bwd:.0f} backward, and replicated memory "
            "and compute). Add a rule (autopar.sharding.rules.register) to keep it split.",
            stacklevel=4,
        )
    n_out = len(info.outputs)
    return Layout(
        [replicated] * n_out,
        ins,
        [replicated] * len(ins),
        (None,) * mesh.ndim,
        reason="no rule: replicated" + (" (inputs gathered)" if split else ""),
        fallback=bool(split),
    )


def check_layouts(graph: fx.Graph, mesh) -> None:
    """Sanity: every tensor node got a layout that can be cut (raises ShardingError)."""
    for node in graph.nodes:
        lay = node.meta.get("autopar")
        if lay is None:
            continue
        for val, spec in zip([v for v in tensor_outputs(node) if v is not None], lay.outputs):
            meta = TensorMeta.of(val)
            static = tuple(s if not d else 0 for s, d in zip(meta.shape, meta.dynamic))
            try:
                check_layout(static, spec, mesh, f"node {node.name!r}")
            except ShardingError as e:
                raise ShardingError(f"{e} (module {module_path(node) or '<top>'!r})") from None
