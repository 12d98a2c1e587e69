"""Which blocks activation checkpointing wraps, and how a block's nodes of the emitted program
become one checkpointed call (the graph half of parallel/activation_checkpoint/technique.py).

A block is a module path (``blocks.3``): by default each of the model's repeated blocks (the
longest ModuleList / Sequential / ModuleDict of identical children, trace/repeat_blocks.py), or the
outermost modules matching ``pattern``; ``every=k`` keeps blocks 0, k, 2k, ... Its *region*
in a program is the run of nodes from the first to the last node that came from the block
(emitted nodes keep their module path): the collectives emission wrote between them belong
to it. ``outline`` moves the region into a GraphModule of its inputs and calls it through a
``recompute.Region``:

    checkpoint_blocks_0 = checkpoint_blocks_0(dropout, blocks_0_ln_1_weight, ..., autopar_rng_state)
    getitem_9 = checkpoint_blocks_0[0]

Reads of the module (parameters, the rank's groups, ``self.training``, the generator state)
are hoisted before the call and passed in, so the body is the same function on every rank;
``plain_eager()`` is asked again inside the body (a selective policy runs the body under a
dispatch mode, where the collectives must take their functional path).

Example:
    >>> blocks = chosen_blocks(plan, ap.ActivationCheckpoint(every=2))   # ['blocks.0', 'blocks.2']
    >>> regions = outline(graph, blocks, make_region)
"""

from __future__ import annotations

import fnmatch
import operator

import torch
import torch.fx as fx

from autopar.errors import PlanError, close_matches
from autopar.runtime.collectives import plain_eager
from autopar.runtime.rng import STATE
from autopar.trace.module_paths import module_paths
from autopar.trace.repeat_blocks import find_repeated


def chosen_blocks(plan, technique) -> list[str]:
    """The module paths ``technique`` checkpoints, in program order (PlanError if none)."""
    in_graph = _paths_in_graph(plan.graph)
    if technique.pattern is not None:
        hits = [p for p in in_graph if fnmatch.fnmatchcase(p, technique.pattern)]
        hits = [p for p in hits if not any(p.startswith(q + ".") for q in hits)]  # outermost only
        if not hits:
            raise PlanError(
                f"ActivationCheckpoint(pattern={technique.pattern!r}) matches no module of the model. "
                f"Closest module paths: {close_matches(technique.pattern, in_graph)}."
            )
    else:
        found = plan.traced.repeated or find_repeated(plan.model, min_blocks=2)
        if found is None:
            raise PlanError(
                "ActivationCheckpoint found no repeated blocks in the model (a ModuleList, Sequential "
                "or ModuleDict keyed '0', '1', ... of identical children): name the modules to "
                "checkpoint with pattern='...' (an fnmatch pattern over module paths, e.g. 'layers.*')."
            )
        hits = [f"{found.prefix}.{i}" for i in range(found.count) if f"{found.prefix}.{i}" in in_graph]
    return hits[:: technique.every]


def _paths_in_graph(graph: fx.Graph) -> list[str]:
    seen: dict[str, None] = {}
    for node in graph.nodes:
        for p in module_paths(node):
            seen.setdefault(p, None)
    return list(seen)


def block_of(node: fx.Node, blocks: set) -> str | None:
    return next((p for p in module_paths(node) if p in blocks), None)


def spans(graph: fx.Graph, blocks: list[str]) -> list[tuple[str, list[fx.Node]]]:
    """(block, its region's nodes in order) for each block with nodes in ``graph``."""
    nodes = list(graph.nodes)
    wanted, first, last = set(blocks), {}, {}
    for i, node in enumerate(nodes):
        b = block_of(node, wanted)
        if b is not None and node.op == "call_function":
            first.setdefault(b, i)
            last[b] = i
    out = []
    for b in blocks:
        if b in first:
            out.append((b, [n for n in nodes[first[b] : last[b] + 1] if n.op in ("call_function", "get_attr")]))
    for (b1, n1), (b2, n2) in zip(out, out[1:]):
        if nodes.index(n1[-1]) >= nodes.index(n2[0]):
            raise PlanError(f"Blocks {b1!r} and {b2!r} interleave in the program: checkpoint one of them only.")
    return out


def _hoist(region: list[fx.Node]) -> list[fx.Node]:
    """Move the module reads (get_attr), plain_eager() and the calls that must not run again in a
    recompute (marked ``autopar_not_recomputed``: zero=3's gathers, whose prefetches are run-time
    state) out of the region, before it, where their inputs allow; the region's other nodes are
    returned."""
    first, body = region[0], []
    inside = set(region)
    for node in region:
        movable = all(a not in inside for a in node.all_input_nodes)
        if node.op == "get_attr" or node.target is plain_eager or (_not_recomputed(node) and movable):
            first.prepend(node)
            inside.discard(node)
        else:
            body.append(node)
    return body


def _not_recomputed(node: fx.Node) -> bool:
    return getattr(node.target, "autopar_not_recomputed", False)


def outline(graph: fx.Graph, blocks: list[str], make_region, buffers=frozenset()) -> list:
    """Replace each block's region of ``graph`` by a call of ``make_region(block, body, inputs,
    mutated)`` (a callable, see recompute.Region); returns the regions made. ``buffers``:
    the model's buffer names (what an op may write in place)."""
    made = []
    for block, region in spans(graph, blocks):
        region = _hoist(region)
        if region:
            made.append(_outline_one(graph, block, region, make_region, buffers))
    for node in list(graph.nodes):  # asked inside every region now, and maybe nowhere else
        if node.target is plain_eager and not node.users:
            graph.erase_node(node)
    return made


def _outline_one(graph: fx.Graph, block: str, region: list[fx.Node], make_region, buffers):
    inside = set(region)
    inputs: dict[fx.Node, None] = {}
    for node in region:
        for a in node.all_input_nodes:
            if a not in inside and a.target is not plain_eager:
                inputs.setdefault(a, None)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    eager = None
    for node in region:

        def arg(a):
            nonlocal eager
            if a.target is plain_eager:
                if eager is None:
                    eager = body.call_function(plain_eager, ())
                return eager
            return env[a]

        env[node] = body.node_copy(node, arg)
    body.output(tuple(env[o] for o in outputs))
    mutated = _mutated_inputs(body, list(inputs), buffers)
    region_fn = make_region(block, fx.GraphModule(torch.nn.Module(), body), list(inputs), mutated)
    with graph.inserting_before(region[0]):
        call = graph.call_function(region_fn, tuple(inputs))
        call.meta["autopar_checkpoint"] = block
        for i, o in enumerate(outputs):
            got = graph.call_function(operator.getitem, (call, i))
            got.meta = dict(o.meta)
            o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for node in reversed(region):
        graph.erase_node(node)
    return region_fn


def _mutated_inputs(body: fx.Graph, inputs: list[fx.Node], buffers) -> list[int]:
    """Positions of the inputs the body may write in place: the dropout generator (every draw
    advances it) and each buffer an op may write (batch norm's running statistics, the batch
    count a lowering advances: ops whose schema marks the argument written, norms that keep
    statistics, and autopar's Python lowerings). The recompute must leave them as the
    forward left them."""
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    out = {i for i, a in enumerate(inputs) if a.op == "get_attr" and a.target == STATE}
    for i, (a, ph) in enumerate(zip(inputs, placeholders)):
        if a.op == "get_attr" and a.target in buffers and any(_writes(u, ph) for u in ph.users):
            out.add(i)
    return sorted(out)


_KEEPS_STATISTICS = {
    torch.ops.aten.batch_norm.default,
    torch.ops.aten.instance_norm.default,
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default,
}


def _writes(user: fx.Node, value: fx.Node) -> bool:
    schema = getattr(user.target, "_schema", None)
    if schema is None:
        return user.target is not operator.getitem  # a Python lowering: assume it may write
    if user.target in _KEEPS_STATISTICS:
        return True
    for i, a in enumerate(schema.arguments):
        got = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
        if got is value and a.alias_info is not None and a.alias_info.is_write:
            return True
    return False
