"""MoE experts modules as one op of the traced graph: ``autopar::moe_experts``.

An experts module (HF Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GraniteMoe, ...) maps tokens
``hidden (T, H)`` routed to ``index (T, k)`` with ``weights (T, k)`` to
``out[t] = sum_j weights[t, j] * expert_{index[t, j]}(hidden[t])``. Traced, it is a sort of the
(token, choice) pairs by expert, a gather of the rows, grouped matmuls over the sorted rows
(``offs``: cumulative rows per expert), the weighting, an inverse permutation and a sum. Split
by tokens, the sort is no slice of the serial sort, so op by op no rule can keep the tokens
split; as a whole the module is token-wise, and that is what expert parallelism needs.

For every module annotated ``ap.expert_parallel(axis)``, ``collapse_expert_blocks`` finds its
nodes, takes out the *expert chain*: the nodes from the gathered rows to the rows that meet
the routing weights (grouped matmuls and what runs between them, row by row; the expert
weights' transposes), and replaces the module's nodes by one ``moe_experts(hidden, index,
weights, params, key)`` node. Its rule (moe_rule.py) keeps tokens split, experts
split or both, and its lowering (dispatch.py) runs the chain on the rows
of this rank's experts: with an all-to-all dispatch where the tokens and the experts are
split on the same axis. The module is checked before it is replaced: the chain, run on the
rows that moe_dispatch.py's route gives, must reproduce the module's traced graph
on random inputs, with one expert receiving no token; otherwise a PlanError names it.

Example:
    >>> collapse_expert_blocks(traced, seeds)   # 'model.layers.0.mlp.experts' -> one moe_experts node
    >>> BLOCKS[node.args[4]].experts, BLOCKS[node.args[4]].top_k
    (8, 2)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import AnnotationError
from autopar.placement import Replicate, Shard, check_divisible
from autopar.parallel.experts.moe_dispatch import route, unroute
from autopar.parallel.experts.lists import (
    list_chain,
    list_expert_modules,
    list_items,
    list_region,
)
from autopar.parallel.experts.tensor_parallel import expert_tp_placements, list_tp_placements
from autopar.trace.graph_walk import ancestors, descendants
from autopar.trace.module_paths import module_paths

aten = torch.ops.aten
GROUPED = {"aten::_grouped_mm", "transformers::grouped_mm_fallback"}
THROUGH = {  # what lies between an expert weight and its grouped matmul
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.view.default,
    aten.reshape.default,
}
CHECK_NUMEL = 1 << 24  # expert weights larger than this (meta-sized models) are not run by the check


@dataclass
class ExpertBlock:
    """One experts module: its expert count, top-k, and its chain (rows, offsets, ids, *params) ->
    rows (``ids``: each row's expert among the weights given, for expert biases). A per-expert
    ModuleList (lists.py) also has its ``expert`` graph (rows, *one expert's params) ->
    rows and ``per_expert`` parameters each, the op's parameters expert after expert."""

    path: str
    experts: int
    top_k: int
    chain: fx.GraphModule
    params: list[str]  # the parameters' serial names, in the op's order
    tp: tuple | None = None  # (mesh axis, each parameter's placement on it): expert tensor parallelism
    expert: fx.GraphModule | None = None  # a ModuleList's one expert
    per_expert: int = 0
    # the experts' split when on one part of their axis (Shard(0, within=k) or Shard(0, across=k))
    grouped: Shard | None = None
    # a ModuleList's: per parameter of one expert, the dim its ``Shard(d, of=...)`` empties on the
    # expert axis (0; 1 for a weight whose dim 0 expert tensor parallelism splits)
    of_dims: tuple = ()

    def of_dim(self, j: int) -> int:
        """The ``of`` dim of the op's parameter ``j`` (a ModuleList's, expert after expert)."""
        return self.of_dims[j % self.per_expert] if self.of_dims else 0

    def local_chain(self, params: int) -> fx.GraphModule:
        """The chain of a rank given ``params`` of the op's parameters (its experts' ones)."""
        if self.expert is None:
            return self.chain
        held = params // self.per_expert
        return self.chain if held == self.experts else list_chain(self.expert, self.per_expert, held)


BLOCKS: dict[str, ExpertBlock] = {}  # key (the op's last argument) -> block


def run_block(block: ExpertBlock, hidden, index, weights, params) -> torch.Tensor:
    """The module's output computed the way a rank computes it, on one rank."""
    rows, order, counts, ids = route(hidden, index, block.experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return unroute(block.chain(rows, offsets, ids, *params), order, weights, hidden.dtype)


# ------------------------------------------------------------------------------------ the op
_LIB = torch.library.Library("autopar", "FRAGMENT")  # noqa: TOR901 - beside runtime/collectives.py's ops
_LIB.define("moe_experts(Tensor hidden, Tensor index, Tensor weights, Tensor[] params, str key) -> Tensor")


def _moe_experts(hidden, index, weights, params, key):
    return run_block(BLOCKS[key], hidden, index, weights, params)


def _moe_experts_fake(hidden, index, weights, params, key):
    return hidden.new_empty(hidden.shape)


_LIB.impl("moe_experts", _moe_experts, "CompositeExplicitAutograd")
torch.library.register_fake("autopar::moe_experts", _moe_experts_fake, lib=_LIB)
MOE_EXPERTS = torch.ops.autopar.moe_experts.default


# ------------------------------------------------------------------------------ the collapse
def grouped_weight_modules(traced) -> dict[str, int]:
    """{module path: number of experts} for every module whose own 3-D weights feed a grouped
    expert matmul (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``), directly or
    through transposes, casts and views."""
    found: dict[str, int] = {}
    for node in traced.gm.graph.nodes:
        if not _is_grouped(node) or len(node.args) < 2:
            continue
        w = node.args[1]
        while isinstance(w, fx.Node) and w.op == "call_function" and w.target in THROUGH:
            w = w.args[0]
        fqn = traced.param_fqn.get(getattr(w, "name", None))
        val = getattr(w, "meta", {}).get("val")
        if fqn is not None and isinstance(val, torch.Tensor) and val.dim() == 3:
            found[fqn.rpartition(".")[0]] = int(val.shape[0])
    return found


def collapse_expert_blocks(traced, seeds, data_axis: int | None = None, mesh=None) -> None:
    """Replace every ``expert_parallel`` module's nodes of ``traced.gm`` by one moe_experts node,
    and those of every other experts module none of whose weights is annotated (plain data
    parallelism then keeps its tokens split instead of gathering them around the sort).

    A module that is not recognised raises a PlanError where its experts are split on the axis
    that splits the batch (``data_axis``: a dispatch is needed); elsewhere it is left as traced
    (its grouped matmuls split by expert, op by op: grouped_mm_rule.py)."""
    graph = traced.gm.graph
    done = _reuse_collapsed(graph, seeds, mesh)
    todo = dict(seeds.experts)
    for path in [*grouped_weight_modules(traced), *list_expert_modules(traced)]:
        if path not in todo and not any(fqn.startswith(path + ".") for fqn in seeds.params):
            todo[path] = None
    lists = list_items(traced)
    changed = False
    try:
        for path, axis in todo.items():
            if path in done:
                continue
            region = _region(graph, path)  # a ModuleList is never called: its items' nodes
            if path in lists:
                region = [n for n in graph.nodes if any(p.startswith(path + ".") for p in module_paths(n))]
            if not region:
                continue
            try:
                block = (
                    _collapse_list(traced, path, len(lists[path])) if path in lists else _collapse(traced, path, region)
                )
            except AnnotationError:
                if (axis is not None and axis == data_axis) or path in seeds.expert_tp:
                    raise
                continue
            changed = True
            block.grouped = _grouped(seeds, block, axis)
            if path in seeds.expert_tp:
                _split_experts(block, seeds, mesh, seeds.expert_tp[path])
    finally:  # a plan refused after a collapse leaves the graph collapsed: the module's code follows it
        if changed:
            graph.lint()
            traced.gm.recompile()


def _reuse_collapsed(graph: fx.Graph, seeds, mesh) -> set[str]:
    """The modules an earlier plan on this graph collapsed (the search's probes and the fuzzer's
    cache share one trace), their splits made this plan's: the expert tensor parallelism, a
    ModuleList's ``of`` dims and the sub-axis split (an earlier plan's, kept, gave a later one
    its strategies and layouts); their paths."""
    done = set()
    for node in graph.nodes:
        if node.target is not MOE_EXPERTS:
            continue
        block = BLOCKS[node.args[4]]
        block.tp, block.of_dims, block.grouped = None, (), _grouped(seeds, block, seeds.experts.get(block.path))
        if block.path in seeds.expert_tp:
            _split_experts(block, seeds, mesh, seeds.expert_tp[block.path])
        done.add(block.path)
    return done


def _grouped(seeds, block: ExpertBlock, axis: int | None) -> Shard | None:
    """The experts' split on one part of ``axis`` (their seeds' Shard.within / across), as
    ``Shard(0, ...)``, or None: split over the whole axis, or not split."""
    specs = [seeds.params.get(fqn) for fqn in block.params]
    found = {
        (spec[axis].within, spec[axis].across)
        for spec in specs
        if axis is not None and spec and isinstance(spec[axis], Shard)
    }
    if len(found) != 1:
        return None
    within, across = found.pop()
    return Shard(0, within=within, across=across) if within or across else None


def _region(graph: fx.Graph, path: str) -> list[fx.Node]:
    """The module's nodes, but the sizes it computes from its inputs' sizes alone (``sym_size``
    of a tensor from outside, products of those): export shares them with later code (the next
    layer's views), so they stay in the graph."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and path in module_paths(n)]
    inside = set(nodes)
    for n in nodes:  # graph order: a size's inputs are decided before it
        if isinstance(n.meta.get("val"), (int, torch.SymInt)) and not any(a in inside for a in n.all_input_nodes):
            inside.discard(n)
    return [n for n in nodes if n in inside]


def _fail(path: str, why: str) -> AnnotationError:
    return AnnotationError(
        f"expert_parallel on module {path!r}: not recognised as a MoE experts module ({why}). "
        "autopar recognises modules called as experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) "
        "that run their experts by grouped matmuls (HF's grouped_mm experts implementation: "
        "config._experts_implementation = 'grouped_mm'), or per-expert ModuleLists looped over as HF's "
        "MoE blocks did up to transformers 4.4x; annotate such a module, or split its weights "
        "with ap.place / ap.colwise instead."
    )


def _collapse(traced, path: str, region: list[fx.Node]) -> ExpertBlock:
    inside = set(region)
    outside_inputs: list[fx.Node] = []
    for n in region:
        for a in n.all_input_nodes:
            if a not in inside and a not in outside_inputs:
                outside_inputs.append(a)
    leaving = [n for n in region if any(u not in inside for u in n.users)]
    if len(leaving) != 1 or not isinstance(leaving[0].meta.get("val"), torch.Tensor):
        raise _fail(path, f"{[n.name for n in leaving]} leave it, expected one tensor")
    out = leaving[0]
    params = [a for a in outside_inputs if traced.param_fqn.get(a.name, "").startswith(path + ".")]
    sizes = [a for a in outside_inputs if isinstance(a.meta.get("val"), (int, torch.SymInt))]  # dynamic T, H
    hidden, index, weights = _token_inputs(path, [a for a in outside_inputs if a not in params + sizes], out)
    chain, top_k = _chain(path, region, hidden, index, weights, params)
    block = ExpertBlock(path, _experts(path, params), top_k, chain, [traced.param_fqn[p.name] for p in params])
    return _replace(traced, block, region, [hidden, index, weights], params, sizes, out)


def _collapse_list(traced, path: str, experts: int) -> ExpertBlock:
    """A per-expert ModuleList's loop as one op (lists.py): the parameters expert after
    expert, each expert's in the order of its names."""
    region, out, expert, suffixes = list_region(traced, path, experts)
    inside = set(region)
    outside_inputs: list[fx.Node] = []
    for n in region:
        outside_inputs += [a for a in n.all_input_nodes if a not in inside and a not in outside_inputs]
    by_name = {traced.param_fqn[a.name]: a for a in outside_inputs if a.name in traced.param_fqn}
    names = [f"{path}.{i}.{s}" for i in range(experts) for s in suffixes]
    missing = [n for n in names if n not in by_name]
    if missing or len(by_name) != len(names):
        raise _fail(path, f"its loop reads parameters {sorted(set(by_name) ^ set(names))} unlike its experts'")
    params = [by_name[n] for n in names]
    sizes = [a for a in outside_inputs if isinstance(a.meta.get("val"), (int, torch.SymInt))]
    hidden, index, weights = _token_inputs(path, [a for a in outside_inputs if a not in params + sizes], out)
    top_k = int(index.meta["val"].shape[-1])
    chain = list_chain(expert, len(suffixes), experts)
    block = ExpertBlock(path, experts, top_k, chain, names, expert=expert, per_expert=len(suffixes))
    return _replace(traced, block, region, [hidden, index, weights], params, sizes, out)


def _replace(traced, block: ExpertBlock, region, tokens: list[fx.Node], params, sizes, out) -> ExpertBlock:
    """``region`` replaced by one moe_experts node, once the block is checked against it."""
    hidden, index, weights = tokens
    path = block.path
    _check(path, block, region, [hidden, index, weights, *params], sizes, out)
    key = f"{path}#{id(traced)}"
    BLOCKS[key] = block
    graph = out.graph
    with graph.inserting_after(out):
        node = graph.call_function(MOE_EXPERTS, (hidden, index, weights, list(params), key))
    node.meta = {k: out.meta[k] for k in ("val", "nn_module_stack", "stack_trace") if k in out.meta}
    out.replace_all_uses_with(node)
    for n in reversed(region):
        graph.erase_node(n)
    return block


def _param_nodes(block: ExpertBlock) -> list[fx.Node]:
    return [n for n in block.chain.graph.nodes if n.op == "placeholder"][3:]


def _split_experts(block: ExpertBlock, seeds, mesh, axis: int) -> None:
    """Expert tensor parallelism on ``axis``: each weight's placement there (tensor_parallel.py), seeded.
    A ModuleList's experts: each expert's linears split the same way (``list_tp_placements``); a
    weight split on its dim 0 is held whole-or-empty by expert on its dim 1 (``Shard(1, of=)``), a
    column bias on its one dim (``Shard(0, of=)``: its owner holds its tp piece); the row bias,
    read as ``Partial()`` by the op, is stored replicated on ``axis``."""
    if block.expert is None:
        placements = expert_tp_placements(block, mesh.shape[axis], _is_grouped, THROUGH)
        shapes = [tuple(node.meta["val"].shape) for node in _param_nodes(block)]
    else:
        one = list_tp_placements(block, mesh.shape[axis])
        placements = one * block.experts
        ph = [n for n in block.expert.graph.nodes if n.op == "placeholder"][1:]
        shapes = [tuple(n.meta["val"].shape) for n in ph] * block.experts
        block.of_dims = tuple(int(isinstance(p, Shard) and p.dim == 0 and len(s) == 2) for p, s in zip(one, shapes))
    for j, (fqn, p, shape) in enumerate(zip(block.params, placements, shapes)):
        spec = list(seeds.params.get(fqn, (Replicate(),) * mesh.ndim))
        spec[axis] = p if isinstance(p, Shard) else Replicate()
        whole = [Replicate() if isinstance(q, Shard) and q.of is not None else q for q in spec]
        check_divisible(shape, tuple(whole), mesh, f"expert weight {fqn!r}")
        listed = [isinstance(q, Shard) and q.of is not None for q in spec]
        spec = [
            Shard(block.of_dim(j), of=q.of, within=q.within, across=q.across) if item else q
            for q, item in zip(spec, listed)
        ]
        seeds.params[fqn] = tuple(spec)
        seeds.reasons[fqn] = f"{seeds.reasons.get(fqn, '')}; each expert split over {mesh.axis_names[axis]!r}"
    block.tp = (axis, tuple(placements))


def _token_inputs(path, others: list[fx.Node], out: fx.Node):
    vals = {a: a.meta.get("val") for a in others}
    tensors = [a for a, v in vals.items() if isinstance(v, torch.Tensor)]
    if len(tensors) != len(others) or len(tensors) != 3:
        raise _fail(path, f"its inputs are {[a.name for a in others]}, expected hidden states, top-k indices, weights")
    hidden = [a for a in tensors if vals[a].dtype.is_floating_point and vals[a].shape == out.meta["val"].shape]
    index = [a for a in tensors if not vals[a].dtype.is_floating_point and vals[a].dim() == 2]
    weights = [a for a in tensors if a not in hidden and a not in index and vals[a].dim() == 2]
    if len(hidden) != 1 or len(index) != 1 or len(weights) != 1:
        raise _fail(path, f"inputs {[(a.name, tuple(vals[a].shape)) for a in tensors]} are not (T, H), (T, k), (T, k)")
    return hidden[0], index[0], weights[0]


def _chain(path, region, hidden, index, weights, params):
    """(the expert chain as a GraphModule (rows, offsets, *params) -> rows, top-k)."""
    inside = set(region)
    gathers = [u for u in hidden.users if u in inside and u.target is aten.index.Tensor and u.args[0] is hidden]
    if len(gathers) != 1:
        raise _fail(path, "no single gather of the hidden states' rows")
    entry = gathers[0]
    rows = descendants([entry], inside)
    weighted = descendants([weights], inside)
    meet = next((n for n in region if n in rows and any(a in weighted for a in n.all_input_nodes)), None)
    if meet is None:
        raise _fail(path, "the expert rows never meet the routing weights")
    last = [a for a in meet.all_input_nodes if a in rows or a is entry]
    if len(last) != 1:
        raise _fail(path, f"{meet.name} mixes the routing weights into the rows more than once")
    body = (ancestors([last[0]], inside) & rows) | {last[0]}
    grouped = [n for n in body if _is_grouped(n)]
    if not grouped:
        raise _fail(path, "no grouped matmul between the gathered rows and the weighting")
    offsets = {_offs(n) for n in grouped}
    if len(offsets) != 1:
        raise _fail(path, "its grouped matmuls do not share one offsets tensor")
    offs = offsets.pop()
    routed = descendants([index], inside)
    ids = _sorted_ids(region, routed)
    sources = set(params) | ({ids} if ids is not None else set())
    from_params = {n for n in inside if n not in rows and n is not ids and _only_from(n, sources, inside)}
    g = fx.Graph()
    env = {entry: g.placeholder("rows"), offs: g.placeholder("offsets")}
    env[ids if ids is not None else object()] = g.placeholder("ids")
    env.update({p: g.placeholder(p.name) for p in params})
    for src, ph in env.items():
        ph.meta["val"] = src.meta.get("val") if isinstance(src, fx.Node) else None
    for n in region:
        if n in env:  # the offsets stay the placeholder: a rank's own (E/n entries after a dispatch)
            continue
        if n in body or (n in from_params and any(u in body for u in _all_users(n, inside))):
            for a in n.all_input_nodes:
                if a not in env:
                    bad = "the routing" if a in routed else "the routing weights" if a in weighted else "outside"
                    raise _fail(path, f"{n.name} reads {a.name} from {bad}; only offsets may reach the experts")
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[last[0]])
    # HF computes the offsets from the sorted ids (histc over all E experts): computed so again
    # inside the chain, they would have E entries where a rank holds E/n experts (eager's
    # grouped matmul read the first E/n; torch.compile's fake kernel refuses); left out, unused
    g.eliminate_dead_code()
    top_k = int(index.meta["val"].shape[-1])
    return fx.GraphModule(torch.nn.Module(), g), top_k


def _sorted_ids(region, routed: set):
    """The sort's values: each sorted row's expert (what expert biases are gathered by), or None."""
    sorts = [n for n in region if n in routed and n.target in (aten.sort.default, aten.sort.stable)]
    items = [u for s in sorts for u in s.users if u.target is operator.getitem and u.args[1] == 0]
    return items[0] if len(items) == 1 else None


def _all_users(n: fx.Node, inside: set) -> set:
    """Users of ``n`` and of what it feeds inside the region (the weights' transposes and casts)."""
    return descendants([n], inside) | {u for u in n.users if u in inside}


def _only_from(n: fx.Node, params: set, inside: set) -> bool:
    ins = n.all_input_nodes
    return bool(ins) and all(a in params or (a in inside and _only_from(a, params, inside)) for a in ins)


def _is_grouped(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.name() in GROUPED


def _offs(n: fx.Node) -> fx.Node:
    return n.args[2] if len(n.args) > 2 else n.kwargs["offs"]


def _experts(path, params) -> int:
    counts = {int(p.meta["val"].shape[0]) for p in params if p.meta["val"].dim() == 3}
    if len(counts) != 1:
        raise _fail(path, "its weights are not 3-D (experts, ., .) with one expert count")
    return counts.pop()


def _check(path, block: ExpertBlock, region, inputs: list[fx.Node], sizes: list[fx.Node], out: fx.Node) -> None:
    """The traced module and the chain around route/unroute agree on random inputs, routing
    that leaves the last expert without a token included."""
    vals = [a.meta["val"] for a in inputs]
    if sum(v.numel() for v in vals[3:]) > CHECK_NUMEL:
        return
    g = torch.Generator().manual_seed(0)
    hidden, index, weights = vals[:3]
    t, k = int(index.shape[0]), int(index.shape[1])
    real = [
        torch.randn(int(hidden.shape[0]), int(hidden.shape[1]), generator=g).to(hidden.dtype),
        torch.randint(0, max(block.experts - 1, 1), (t, k), generator=g).to(index.dtype),
        torch.rand(t, k, generator=g).to(weights.dtype),
    ]
    real += [(torch.randn(tuple(int(s) for s in v.shape), generator=g) / 4).to(v.dtype) for v in vals[3:]]
    gm = _region_module(region, inputs + sizes, out)
    with torch.no_grad():
        want = gm(*real, *(_hint(a.meta["val"]) for a in sizes))
        got = run_block(block, real[0], real[1], real[2], real[3:])
    if not torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-4):
        err = (got.float() - want.float()).abs().max().item()
        raise _fail(
            path, f"its graph computes something else than routed experts weighted and summed (max error {err:.3g})"
        )


def _hint(size) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _region_module(region, inputs: list[fx.Node], out: fx.Node) -> fx.GraphModule:
    g = fx.Graph()
    env = {a: g.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
    for n in region:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return fx.GraphModule(torch.nn.Module(), g)
