"""Per-expert ``nn.ModuleList`` experts (HF's MoE blocks up to transformers 4.4x: Mixtral's
``experts[i].w1/w2/w3``, Qwen2-MoE's / OLMoE's ``experts[i].gate_proj/up_proj/down_proj``)
as the same ``autopar::moe_experts`` op as stacked 3-D experts (blocks.py).

Traced, such a block loops over its experts: ``one_hot`` of the top-k indices, per expert
``torch.where(expert_mask[i])`` (rows of a data-dependent count), the expert's MLP on the
gathered rows, times the routing weights, ``index_add_`` into a zeros tensor. The *region*
taken out is what lies between the block's top-k indices (the input of ``one_hot``), its
hidden states and routing weights, and the first node every expert's output reaches (the
last ``index_add_``); the router, a shared expert and what follows stay. The *expert*: the
nodes of ``experts.0`` as a graph ``(rows, *its parameters) -> rows``; the block's chain
runs it once per expert on that expert's rows (split by the offsets), each with its own
parameters. A rank holding E/n experts runs it E/n times with theirs: the parameters keep
their names (``experts.3.w1.weight``), each stored whole on the rank that owns it and empty
elsewhere (``Shard(0, of=(3, E))``, placement.py).

Example:
    >>> list_expert_modules(traced)          # {'model.layers.0.mlp.experts': 8}
    >>> region, out, expert, suffixes = list_region(traced, 'model.layers.0.mlp.experts', 8)
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from autopar.errors import AnnotationError
from autopar.trace.graph_walk import ancestors, descendants
from autopar.trace.module_paths import module_paths

aten = torch.ops.aten
ITEM = re.compile(r"^(.+)\.(\d+)\.(.+)$")  # 'path.3.w1.weight' -> path, 3, 'w1.weight'
FRESH = {aten.zeros_like.default, aten.new_zeros.default, aten.empty_like.default, aten.full_like.default}
VIEWS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default, aten.alias.default}


def list_items(traced) -> dict[str, dict[int, list[str]]]:
    """{list path: {item: its parameters' names below it, sorted}} for every ModuleList-like path."""
    found: dict[str, dict[int, list[str]]] = {}
    for fqn in traced.param_fqn.values():
        m = ITEM.match(fqn)
        if m:
            found.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(m.group(3))
    return {path: {i: sorted(s) for i, s in items.items()} for path, items in found.items()}


def list_expert_modules(traced) -> dict[str, int]:
    """{ModuleList path: number of experts} for lists of at least 2 modules with the same
    parameters whose first item runs on rows of a data-dependent count (the rows routed to it)."""
    out = {}
    for path, items in list_items(traced).items():
        if len(items) < 2 or sorted(items) != list(range(len(items))):
            continue
        if any(items[i] != items[0] for i in items) or not _runs_on_routed_rows(traced.gm.graph, f"{path}.0"):
            continue
        out[path] = len(items)
    return out


def _runs_on_routed_rows(graph: fx.Graph, scope: str) -> bool:
    # imported here: symbolic_shapes loads sympy (~1 s), which import autopar need not pay
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in graph.nodes:
        if n.op == "call_function" and scope in module_paths(n):
            val = n.meta.get("val")
            return isinstance(val, torch.Tensor) and val.dim() > 0 and bool(free_unbacked_symbols(val.shape[0]))
    return False


def _fail(path: str, why: str) -> AnnotationError:
    return AnnotationError(
        f"expert_parallel on module {path!r}: not recognised as a per-expert ModuleList MoE ({why}). "
        "autopar recognises lists of identical expert modules looped over as HF's MoE blocks did "
        "(one_hot of the top-k indices, torch.where(expert_mask[i]) rows through experts[i], times the "
        "routing weights, index_add_ into the output); annotate the module holding stacked 3-D expert "
        "weights otherwise, or split the weights with ap.place / ap.colwise."
    )


def list_region(traced, path: str, experts: int):
    """(the region's nodes in graph order, its one output, the expert graph (rows, *params) ->
    rows taken from item 0, the parameters' names below each item) of the list at ``path``."""
    graph = traced.gm.graph
    block = path.rpartition(".")[0]
    nodes = [n for n in graph.nodes if n.op == "call_function" and (not block or block in module_paths(n))]
    inside = set(nodes)
    items = [[n for n in nodes if f"{path}.{i}" in module_paths(n)] for i in range(experts)]
    if any(not item for item in items):
        raise _fail(path, "some experts never run")
    outs = []
    for item in items:
        own = set(item)
        leaving = [n for n in item if any(u not in own for u in n.users)]
        if len(leaving) != 1:
            raise _fail(path, f"{[n.name for n in leaving]} leave expert {items.index(item)}, expected one tensor")
        outs.append(leaving[0])
    out = _first_reached_by_all(nodes, outs)
    if out is None:
        raise _fail(path, "no node combines every expert's output")
    region = _region(path, nodes, inside, out)
    return region, out, _expert_graph(traced, path, items[0], outs[0]), list_items(traced)[path][0]


def _first_reached_by_all(nodes: list[fx.Node], outs: list[fx.Node]):
    reached: dict[fx.Node, frozenset] = {}
    everything = frozenset(range(len(outs)))
    for n in nodes:
        got = frozenset().union(*(reached.get(a, frozenset()) for a in n.all_input_nodes))
        if n in outs:
            got |= {outs.index(n)}
        reached[n] = got
        if got == everything and n not in outs:
            return n
    return None


def _region(path, nodes, inside, out) -> list[fx.Node]:
    """What ``out`` computes from the top-k indices, plus the tensors it makes from nothing (the
    zeros it accumulates into), the views of outside tensors that only it reads (the rows'
    ``unsqueeze``) and the checks that hang off it (export's asserts on the rows' counts)."""
    before = ancestors([out], inside)
    hots = [n for n in before if n.target is aten.one_hot.default]
    if len(hots) != 1:
        raise _fail(path, f"{len(hots)} one_hot of the top-k indices, expected one")
    index = hots[0].args[0]
    routed = descendants([index], inside)
    core = {n for n in before if n in routed or n.target in FRESH or all(_is_size(a) for a in n.all_input_nodes)}
    for n in sorted(before - core, key=nodes.index, reverse=True):  # users first
        if n.target in VIEWS and n.users and all(u in core for u in n.users):
            core.add(n)
    added: set = set()
    for n in nodes:  # hanging off: reads only the region, nothing outside reads it
        if n not in core and n.all_input_nodes and all(a in core or a in added for a in n.all_input_nodes):
            added.add(n)
    changed = True
    while changed:
        changed = False
        for n in list(added):
            if any(u not in core and u not in added for u in n.users):
                added.discard(n)
                changed = True
    core |= added
    return [n for n in nodes if n in core]


def _is_size(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (int, torch.SymInt))


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _expert_graph(traced, path: str, item: list[fx.Node], last: fx.Node) -> fx.GraphModule:
    """Item 0's nodes as a graph (rows, *its parameters in name order) -> rows."""
    own = set(item)
    outside = []
    for n in item:
        outside += [a for a in n.all_input_nodes if a not in own and a not in outside]
    params = {traced.param_fqn[a.name]: a for a in outside if a.name in traced.param_fqn}
    rows = [a for a in outside if a.name not in traced.param_fqn]
    if len(rows) != 1 or not _is_tensor(rows[0]):
        raise _fail(path, f"expert 0 reads {[a.name for a in rows]} besides its parameters, expected its rows")
    prefix = f"{path}.0."
    names = sorted(params)
    if any(not fqn.startswith(prefix) for fqn in names):
        raise _fail(
            path, f"expert 0 reads parameters of other modules: {[f for f in names if not f.startswith(prefix)]}"
        )
    g = fx.Graph()
    env = {rows[0]: g.placeholder("rows")}
    for fqn in names:
        env[params[fqn]] = g.placeholder(fqn[len(prefix) :].replace(".", "_"))
    for src, ph in env.items():
        ph.meta["val"] = src.meta.get("val")
    for n in item:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[last])
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.autopar_suffixes = [fqn[len(prefix) :] for fqn in names]
    return gm


# -------------------------------------------------------------------- the chain of a rank
def split_rows(rows: torch.Tensor, offsets: torch.Tensor):
    """Rows grouped by expert cut at ``offsets`` (cumulative rows per expert): one piece each."""
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.split(rows, counts.tolist())


def owned_items(items: list, first, count: int) -> list:
    """``items[first : first + count]``: the parameters of a rank's experts (``first`` is a value
    of the rank program: its coordinate times the experts it holds, times their parameters)."""
    return list(items[first : first + count])


def tie_others(rows: torch.Tensor, items: list, first, count: int) -> torch.Tensor:
    """``rows`` plus an exact 0 from each of ``items`` outside ``first .. first + count - 1``
    (the other ranks' experts: empty pieces here), so that every parameter gets a gradient on
    every rank (empty there) and the gradient sync's hooks fire for each, as for any parameter."""
    for t in items[:first] + items[first + count :]:
        rows = rows + t.reshape(-1)[:0].sum()
    return rows


def list_chain(expert: fx.GraphModule, per_expert: int, experts: int) -> fx.GraphModule:
    """The chain (rows, offsets, ids, *params) -> rows of ``experts`` experts (``per_expert``
    parameters each, in order): ``expert`` run on each expert's rows with its parameters."""
    g = fx.Graph()
    rows, offsets = g.placeholder("rows"), g.placeholder("offsets")
    g.placeholder("ids")
    params = [g.placeholder(f"p{i}") for i in range(per_expert * experts)]
    parts = g.call_function(split_rows, (rows, offsets))
    ph = [n for n in expert.graph.nodes if n.op == "placeholder"]
    outs = []
    for j in range(experts):
        x = g.call_function(operator.getitem, (parts, j))
        outs.append(g.graph_copy(expert.graph, dict(zip(ph, [x, *params[j * per_expert : (j + 1) * per_expert]]))))
    g.output(g.call_function(torch.cat, (outs,)) if outs else rows)
    return fx.GraphModule(torch.nn.Module(), g)
