"""debug=True: before the first collective, all ranks check they run the same collectives.

Ranks that planned differently (another annotation, model config, mesh or example shape on
one rank) would otherwise pair unrelated collectives: a hang, or silently wrong numbers.
Each rank hashes its plan (every node's layout and strategy, the gradient sync) and lists
the collectives its module issues, in order, with their groups; the ranks exchange these
with their plan fingerprints (fingerprint.py: one all_gather_object in every ap.parallelize)
and compare: the plan hashes must be equal, and the members of each group must issue the
same collectives on it in the same order.

Example:
    >>> module = ap.parallelize(model, mesh, args=(x,), annotations=ann, debug=True)
    autopar.errors.InconsistentPlanError: ranks disagree on the plan: rank 1 has 5c1e..., rank 0 has 9a0f...;
    first differing collective over ranks (0, 1): #0 is all_reduce(...) on rank 0, all_gather(...) on rank 1 ...
"""

from __future__ import annotations

import hashlib

import torch
import torch.fx as fx

from autopar.errors import InconsistentPlanError
from autopar.placement import fmt_spec


def plan_hash(plan) -> str:
    """A hash of everything that decides which collectives a rank runs."""
    h = hashlib.sha256(repr((plan.mesh.shape, plan.mesh.axis_names, plan.batch_axis)).encode())
    for node in plan.graph.nodes:
        lay = node.meta.get("autopar")
        text = f"{node.name}|{node.target}"
        if lay is not None:
            text += (
                "|"
                + ";".join(fmt_spec(s) for s in lay.outputs)
                + "|"
                + ";".join(fmt_spec(s) for s in lay.input_targets)
                + "|"
                + repr(lay.strategies)
            )
        h.update(text.encode())
    h.update(repr(sorted((k, sorted(v)) for k, v in plan.flow.f_edges.items())).encode())
    h.update(repr(sorted(plan.grad_sync_axes.items())).encode())
    return h.hexdigest()[:16]


def collective_sequence(module: fx.GraphModule) -> list[tuple]:
    """(kind, group, arguments) of every collective in ``module``'s graph, in order."""
    out = []
    for node in module.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != "autopar":
            continue
        args = [_resolved(module, a) for a in node.args]
        args = [a for a in args if not isinstance(a, fx.Node)]
        at = next(
            (i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and all(isinstance(r, int) for r in a)), None
        )  # the group: a list of ranks
        if at is None:  # not a collective (scale_grad, opaque_call: local ops)
            continue
        group = tuple(args[at])
        rest = tuple(args[:at] + args[at + 2 :])
        out.append((target._opname, group, rest))  # rest: dims, axis name, op (the group and rank dropped)
    return out


def _resolved(module, a):
    """A get_attr argument (the rank's group, its rank) as the value the module holds."""
    if isinstance(a, fx.Node) and a.op == "get_attr":
        value = getattr(module, a.target, a)
        return a if isinstance(value, torch.Tensor) else value
    return a


def compare(signatures: list[tuple[str, list]]) -> None:
    """Raise InconsistentPlanError when ranks' (hash, collectives) disagree."""
    hashes = {}
    for r, (h, _) in enumerate(signatures):
        hashes.setdefault(h, []).append(r)
    problems = []
    if len(hashes) > 1:
        groups = "; ".join(f"ranks {rs} have plan {h}" for h, rs in hashes.items())
        problems.append(f"ranks disagree on the plan: {groups}")
    first = _first_collective_difference(signatures)
    if first:
        problems.append(first)
    if problems:
        raise InconsistentPlanError(
            ". ".join(problems) + ". Every rank must call ap.parallelize / ap.plan with the same model "
            "(architecture and config), annotations, mesh, data_parallel axis and example input shapes."
        )


def _first_collective_difference(signatures) -> str:
    per_group: dict[tuple, dict[int, list]] = {}
    for r, (_, seq) in enumerate(signatures):
        for kind, group, rest in seq:
            per_group.setdefault(group, {}).setdefault(r, []).append((kind, rest))
    for group in sorted(per_group):
        seqs = {r: per_group[group].get(r, []) for r in group}
        ref_rank = group[0]
        for r in group[1:]:
            a, b = seqs[ref_rank], seqs[r]
            for i in range(max(len(a), len(b))):
                x = a[i] if i < len(a) else None
                y = b[i] if i < len(b) else None
                if x != y:
                    return (
                        f"first differing collective over ranks {group}: #{i} is {_fmt(x)} on rank "
                        f"{ref_rank} but {_fmt(y)} on rank {r}"
                    )
    return ""


def _fmt(entry) -> str:
    if entry is None:
        return "nothing (no more collectives)"
    kind, rest = entry
    return f"{kind}({', '.join(map(repr, rest))})"
