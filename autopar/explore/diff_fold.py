"""plan.diff's text with repeated blocks folded: the blocks whose changes are the same (the same
modules, layouts and collectives, node names aside) are written once, so that a diff of two
plans of a 32-layer model reads as long as one of a 2-layer model.

Example:
    >>> print(plan_tp.diff(plan_sp))
    56 nodes and 0 parameters differ (Mesh(dp=2, tp=2) vs Mesh(dp=2, tp=2))
      ...
      model.layers.0-1 x 2, the same changes in each (block 0's nodes):
        to_6 (input_layernorm): (S(0), R) -> (S(0), S(1))
"""

from __future__ import annotations

from autopar.explore.module_tree import index_text


def split_block(path: str) -> tuple[str, int, str] | None:
    """'model.layers.3.mlp.fc' -> ('model.layers', 3, 'mlp.fc'); None without a block index."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i]), int(p), ".".join(parts[i + 1 :])
    return None


def node_line(d, module: str) -> str:
    line = f"{d.node} ({module or '<top>'}): {d.layout[0]} -> {d.layout[1]}"
    return line + (f"; {d.comms[0] or '-'} -> {d.comms[1] or '-'}" if d.comms[0] != d.comms[1] else "")


def fold_node_lines(nodes) -> list[str]:
    """The diff's node lines, each run of blocks with the same changes written once."""
    blocks: dict = {}  # (prefix, index) -> [NodeDiff, rest of its module path]
    for d in nodes:
        where = split_block(d.module)
        if where is not None:
            blocks.setdefault(where[:2], []).append((d, where[2]))
    groups: dict = {}  # (prefix, signature) -> block indices
    for (prefix, i), entries in blocks.items():
        sig = tuple((rest, d.layout, d.comms) for d, rest in entries)
        groups.setdefault((prefix, sig), []).append(i)
    first_of = {(prefix, idx[0]): (prefix, idx) for (prefix, _), idx in groups.items()}
    lines = []
    for d in nodes:
        where = split_block(d.module)
        if where is None:
            lines.append("  " + node_line(d, d.module))
            continue
        if where[:2] not in first_of or blocks[where[:2]][0][0] is not d:
            continue  # written with its block, or folded into the first block with its changes
        prefix, idx = first_of[where[:2]]
        head = f"{prefix}.{index_text(idx)}"
        lines.append(
            f"  {head} x {len(idx)}, the same changes in each (block {idx[0]}'s nodes):"
            if len(idx) > 1
            else f"  {head}:"
        )
        lines += ["    " + node_line(e, rest or "the block") for e, rest in blocks[where[:2]]]
    return lines


def fold_param_lines(params: dict) -> list[str]:
    """'parameter model.layers.{0-31}.mlp.up_proj.weight: (R, R) -> (R, S(0))', one line per change."""
    groups: dict = {}
    for name, change in params.items():
        where = split_block(name)
        key = (name, None, change) if where is None else (where[0], where[2], change)
        groups.setdefault(key, []).append(None if where is None else where[1])
    lines = []
    for (head, rest, (x, y)), idx in groups.items():
        name = (
            head
            if rest is None
            else f"{head}.{{{index_text(idx)}}}.{rest}"
            if len(idx) > 1
            else f"{head}.{idx[0]}.{rest}"
        )
        lines.append(f"  parameter {name}: {x} -> {y}")
    return lines
