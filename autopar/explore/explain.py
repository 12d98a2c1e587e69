"""plan.explain(name): why a node, parameter, input or module got its layout and collectives.

For a node: the rule and the strategy chosen on each axis, the alternatives with their costs,
what each input needed, why each collective next to it is there, and the chain back to the
annotation each split comes from. For a parameter or input: its annotation, its layout and
local shape, who consumes it, and whether (and why) its gradient is summed. For a module
path: its parameters and annotation, then every op in it that has collectives.

Example:
    >>> print(plan.explain("blocks.0.mlp.fc"))
    >>> print(plan.explain("linear_default_2"))
    >>> print(plan.explain("blocks.0.mlp.fc.weight"))
"""

from __future__ import annotations

from autopar.sharding.lowerings.base import lowering_for
from autopar.explore.display import Text, comm_label, fmt_bytes, op_name
from autopar.errors import PlanError, close_matches
from autopar.placement import Replicate, fmt_spec, local_shape, piece_sizes, uneven_dims
from autopar.sharding.propagate import layout_of
from autopar.trace.module_paths import module_path, module_paths
from autopar.sharding.redistribute import plan_steps
from autopar.parallel.dp_module import sync_axes_all_names
from autopar.explore.auto_explain import module_reason, search_text

R = Replicate()


def explain(plan, name: str) -> Text:
    rec = plan.built.get("auto")
    if name == "auto" and rec:
        return Text(search_text(rec))
    nodes = {n.name: n for n in plan.graph.nodes if "autopar" in n.meta}
    params = dict(plan.model.named_parameters(remove_duplicate=False))
    modules = {p for n in plan.graph.nodes for p in module_paths(n)}
    comms = plan.collectives()
    if name in params:
        return Text(_explain_param(plan, name, comms))
    if name in nodes:
        return Text(_explain_node(plan, nodes[name], comms))
    if name in modules or name in dict(plan.model.named_modules()):
        return Text(_explain_module(plan, name, comms))
    known = list(nodes) + list(params) + sorted(modules)
    raise PlanError(
        f"plan.explain: {name!r} is not a node, parameter, input or module path of this "
        f"plan. Closest: {close_matches(name, known)}."
    )


def _axis(plan, a) -> str:
    return plan.mesh.axis_label(a)  # an index, or a SubAxis (the replica groups of experts split within groups)


def comm_reason(plan, c) -> str:
    """One sentence on why collective ``c`` runs."""
    if c.reason:
        return c.reason
    if c.phase == "grad sync":
        return (
            "gradient sync: these parameters' gradients arrive in parts on "
            f"{c.axis} (each rank computed with its own piece of the data); one bucketed "
            "all-reduce sums them after backward"
        )
    nodes = {n.name: n for n in plan.graph.nodes}
    src, dst = nodes.get(c.src), nodes.get(c.node)
    lowering = lowering_for(layout_of(dst).strategies) if dst is not None and "autopar" in dst.meta else None
    if lowering is not None and c.src == "":  # a collective inside the lowering, not on an edge
        return lowering[0].reason(c.axis)
    if src is None or dst is None:
        return ""
    have = fmt_spec(layout_of(src).spec)
    need = _target_of(plan, src, dst)
    if c.phase == "backward" and c.kind == "all_reduce" and (need is None or fmt_spec(need) == have):
        return (
            f"Megatron's f: {src.name} {have} is replicated on {c.axis} and feeds computation split "
            f"on {c.axis}, so each rank's gradient is only its part; all-reduced in backward"
        )
    why = f"{src.name} is {have} but {dst.name} needs {fmt_spec(need)}"
    if c.phase == "backward":
        return f"backward of that redistribution ({why})"
    return why


def _target_of(plan, src, dst):
    if dst.op == "output":
        return plan.output_target(layout_of(src).spec)
    lay = layout_of(dst)
    for inp, tgt in zip(lay.inputs, lay.input_targets):
        if inp is src:
            return tgt
    return None


def _explain_node(plan, node, comms) -> str:
    lay = layout_of(node)
    lines = [
        f"node {node.name} ({op_name(node)}, module {module_path(node) or '<top>'}) -> "
        f"{' '.join(fmt_spec(s) for s in lay.outputs) or 'no tensor output'}",
        f"  why: {lay.reason or '-'}",
    ]
    if node.op == "placeholder":
        return "\n".join(lines + _consumers(plan, node, comms))
    if lay.alternatives:
        lines.append("  strategies considered (axis: strategy, cost = bytes moved, moves of parameters x16):")
        for a, text, cost in lay.alternatives:
            chosen = lay.strategies[a] is not None and repr(lay.strategies[a]) == text
            lines.append(f"    {_axis(plan, a)}: {text}  {cost:.0f}{'  <- chosen' if chosen else ''}")
    for i, (inp, tgt) in enumerate(zip(lay.inputs, lay.input_targets)):
        cur = layout_of(inp).spec
        steps = [s for s in plan_steps(cur, tgt) if s.communicates] if cur else []
        how = (
            "as is"
            if cur == tgt
            else f"redistributed to {fmt_spec(tgt)}"
            + (f" ({', '.join(s.kind + ' on ' + _axis(plan, s.axis) for s in steps)})" if steps else " (local)")
        )
        lines.append(f"  input {i}: {inp.name} {fmt_spec(cur) if cur else '-'} used {how}")
    here = [c for c in comms if c.node == node.name]
    if here:
        lines.append("  collectives on its inputs:")
        lines += [
            f"    {comm_label(c)} {fmt_bytes(c.bytes)}{'' if c.formula is None else f' = {c.formula}'}: "
            f"{comm_reason(plan, c)}"
            for c in here
        ]
    lines += _consumers(plan, node, comms)
    lines += _origins(plan, node)
    return "\n".join(lines)


def _consumers(plan, node, comms=()) -> list[str]:
    """Users that need this value in another layout, and the collectives that makes."""
    out = []
    for user in node.users:
        if "autopar" not in user.meta and user.op != "output":
            continue
        tgt = _target_of(plan, node, user)
        if tgt is None or tgt == layout_of(node).spec:
            continue
        moved = [c for c in comms if c.node == user.name and c.src == node.name]
        what = ", ".join(f"{comm_label(c)} {fmt_bytes(c.bytes)}" for c in moved) or "a local slice"
        out.append(f"  used by {user.name} ({op_name(user)}) as {fmt_spec(tgt)}: {what}")
    return out


def _origins(plan, node) -> list[str]:
    """For each axis where the output is split or partial: the chain back to a seed."""
    out = []
    spec = layout_of(node).spec or ()
    for a, p in enumerate(spec):
        if p.is_replicate():
            continue
        chain, cur = [node], node
        while cur.op != "placeholder" and len(chain) < 200:
            lay = layout_of(cur)
            targets = lay.input_targets or [layout_of(i).spec for i in lay.inputs]  # getitem: as is
            nxt = [
                i
                for i, t in zip(lay.inputs, targets)
                if layout_of(i).spec and not layout_of(i).spec[a].is_replicate() and t[a] == layout_of(i).spec[a]
            ]
            if not nxt:
                break
            cur = nxt[0]
            chain.append(cur)
        if len(chain) == 1 and cur.op != "placeholder":
            out.append(f"    {_axis(plan, a)}: {p!r} is created here by the chosen strategy")
            continue
        path = " <- ".join(n.name for n in chain[:4]) + (
            f" <- ... ({len(chain) - 5} more) <- {chain[-1].name}"
            if len(chain) > 5
            else "".join(f" <- {n.name}" for n in chain[4:])
        )
        seed = layout_of(cur).reason if cur.op == "placeholder" else "created by its strategy"
        out.append(f"    {_axis(plan, a)}: {p!r} comes from {path}: {seed}")
    return ["  where the split comes from:"] + out if out else []


def _local_shapes(shape, spec, mesh) -> str:
    """'local shape (17, 16) on every rank', or each rank's where the pieces are uneven."""
    shapes = [local_shape(shape, spec, mesh, mesh.coords(r)) for r in mesh.ranks()]
    if len(set(shapes)) == 1:
        return f"local shape {shapes[0]} on every rank"
    uneven = ", ".join(
        f"dim {d} ({size} rows on {mesh.axis_names[axis]}={mesh.shape[axis]}: pieces "
        f"{', '.join(map(str, piece_sizes(size, mesh.shape[axis])))})"
        for d, (size, axis) in uneven_dims(shape, spec, mesh).items()
    )
    return f"local shapes {' '.join(str(s) for s in dict.fromkeys(shapes))} (uneven pieces, as torch.tensor_split cuts: {uneven})"


def _explain_param(plan, fqn, comms) -> str:
    spec = plan.param_specs.get(fqn, (R,) * plan.mesh.ndim)
    p = dict(plan.model.named_parameters(remove_duplicate=False))[fqn]
    tied = [names for names in plan.traced.tied.values() if fqn in names]
    same = set(tied[0]) if tied else {fqn}
    phs = [n for n in plan.graph.nodes if n.op == "placeholder" and plan.attr_name(n.name) in same]
    reason = plan.seeds.reasons.get(fqn) or next((layout_of(n).reason for n in phs), "replicated (no annotation)")
    lines = [f"parameter {fqn} {tuple(p.shape)} -> {fmt_spec(spec)}, {_local_shapes(tuple(p.shape), spec, plan.mesh)}"]
    lines.append(f"  why: {reason}")
    if tied:
        lines.append(f"  tied with {', '.join(n for n in tied[0] if n != fqn)}: one tensor, one layout")
    axes = sync_axes_all_names(plan).get(fqn, ())  # what the gradient buckets sync (tied names, techniques)
    stored = [line for t in plan.options.techniques for line in t.explain_param(plan, fqn)]
    lines += [f"  {line}" for line in stored]
    if axes:
        names = ", ".join(_axis(plan, a) for a in axes)
        lines.append(
            f"  gradient summed over {names} by the gradient sync: it arrives in parts there "
            "(each rank used its own piece of the activations)"
        )
    elif p.requires_grad and not stored:
        lines.append("  gradient complete on each rank: no sync needed")
    for ph in phs:
        for user in ph.users:
            if "autopar" in user.meta and layout_of(user).outputs:  # a tied name's users too
                lines.append(
                    f"  used by {user.name} ({op_name(user)}, {module_path(user) or '<top>'}) "
                    f"-> {fmt_spec(layout_of(user).spec)}"
                )
    return "\n".join(lines)


def _explain_module(plan, path, comms) -> str:
    own = [n for n, _ in plan.model.named_parameters() if n.startswith(path + ".")]
    lines = [f"module {path}"]
    if path in plan.seeds.reasons:
        lines.append(f"  annotation: {plan.seeds.reasons[path]}")
    if path in plan.seeds.module_outputs:
        wanted = ", ".join(f"{_axis(plan, a)}: {p!r}" for a, p in plan.seeds.module_outputs[path].items())
        lines.append(f"  its output must leave as {wanted} (the annotation's output layout)")
    for n in own:
        lines.append(
            f"  parameter {n} {fmt_spec(plan.param_specs.get(n, ()))}: "
            f"{plan.seeds.reasons.get(n, 'replicated (no annotation)')}"
        )
    lines += [line for t in plan.options.techniques for line in t.explain_module(plan, path)]
    inside = [c for c in comms if c.module == path or c.module.startswith(path + ".")]
    total = sum(c.bytes for c in inside)
    lines.append(f"  collectives: {len(inside)}, {fmt_bytes(total)} per step and rank")
    lines += [f"    {c.node}: {comm_label(c)} {fmt_bytes(c.bytes)}: {comm_reason(plan, c)}" for c in inside]
    if plan.built.get("auto"):
        why = module_reason(plan.built["auto"], path)
        lines += [why] if why else []
    return "\n".join(lines)
