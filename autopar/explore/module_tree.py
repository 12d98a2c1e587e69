"""The plan as a tree of modules with repeated blocks folded: what ``print(plan)`` and the
notebook view show, so that their size follows the model's distinct structure, not its depth.

Every op row (``plan_rows``) goes under the module that made it, in graph order. Sibling
blocks (``layers.0``, ``layers.1``, ...) whose plans are the same (the same ops, layouts,
parameter placements, collectives and bytes; node names aside) fold into one node,
``layers.0-31 x 32``, wherever they stand (alternating layers: ``layers.1-31 step 2``). A block
or fold that differs from a list's first says what differs first. On a pipeline, the stage
is part of a block's plan: blocks on different stages fold apart, each fold's line saying its
stage once (``layers.0-15 x 16, identical plan, stage 0``; where a module spans several, its
parts say theirs). The
pseudo-modules ``(top)`` (the model's own forward: loss, outputs), ``(outputs)`` and
``(grad sync)`` sit at the top level beside the model's modules.

Example:
    >>> tree = module_tree(plan)
    >>> [c.name for c in tree.children()]          # ['model', 'lm_head', '(top)', '(grad sync)']
    >>> fold = tree.find("model.layers.0")         # the fold: fold.name == 'layers.0-31', fold.count == 32
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from autopar.explore.display import Row, comm_label, fmt_bytes, plan_rows
from autopar.placement import fmt_spec

TOP = "(top)"  # the model's own forward (cost.layer_of names it so too)
PSEUDO = ("(outputs)", "(grad sync)", "(model)")


@dataclass
class ModuleNode:
    """One module (or a fold of identical blocks): its own ops and sub-modules in graph order."""

    name: str  # shown relative to the parent: 'self_attn', 'layers.0-31'
    path: str  # the full path of the (first) block: 'model.layers.0.self_attn'
    items: list = field(default_factory=list)  # Row | ModuleNode, in the order the graph reaches them
    params: list = field(default_factory=list)  # (local name, placements text) of its own parameters
    paths: tuple = ()  # a fold: the path of every block in it
    differs: str = ""  # a block shown apart: its first difference from the block before
    stage_text: str = ""  # ', stage 1': on a pipeline, where this node's stage is first said

    @property
    def count(self) -> int:
        return len(self.paths) or 1

    def children(self) -> list[ModuleNode]:
        return [i for i in self.items if isinstance(i, ModuleNode)]

    def rows(self) -> list[Row]:
        return [i for i in self.items if isinstance(i, Row)]

    def all_rows(self) -> list[Row]:
        """The rows of the whole subtree (one block of a fold), graph order."""
        out = []
        for i in self.items:
            out += i.all_rows() if isinstance(i, ModuleNode) else [i]
        return out

    def comms(self) -> list:
        """The collectives of the subtree, each folded block's counted (a fold repeats its first block's)."""
        out = []
        for i in self.items:
            out += i.comms() if isinstance(i, ModuleNode) else i.comms
        return out * self.count

    def bytes(self) -> float:
        """Bytes per step and rank of the subtree, all folded blocks together."""
        return sum(c.bytes for c in self.comms())

    def layout(self) -> str:
        """The layout of the last tensor it makes (its output, for a module that returns one)."""
        rows = [r for r in self.all_rows() if r.layout != "-"]
        return rows[-1].layout if rows else ""

    def comm_summary(self) -> str:
        """'all_reduce(tp) x2, all_gather(tp, bwd)': the subtree's collectives, counted by kind."""
        return count_labels(self.comms())

    def bytes_text(self) -> str:
        total = self.bytes()
        if not total:
            return ""
        return fmt_bytes(total) + (f" ({fmt_bytes(total / self.count)} each)" if self.count > 1 else "")

    def title(self) -> str:
        """The node's line: 'layers.0-31 x 32, identical plan' for a fold."""
        if self.count > 1:
            return f"{self.name} x {self.count}, identical plan{self.stage_text}"
        return self.name + self.stage_text

    def stages(self) -> tuple:
        """The pipeline stages the subtree's ops run on (empty without a pipeline)."""
        return tuple(sorted({r.stage for r in self.all_rows() if r.stage is not None}))

    def find(self, path: str) -> ModuleNode | None:
        """The node showing module ``path`` (a folded block finds its fold)."""
        for c in self.children():
            if c.path == path or path in c.paths:
                return c
            hit = c.find(path)
            if hit is not None:
                return hit
        return None

    def signature(self) -> tuple:
        """What must be equal for two blocks to fold: everything shown but node names."""
        return (
            self.name if self.count > 1 else "",
            self.stages(),
            tuple(self.params),
            tuple(_sig(i) for i in self.items),
        )


def count_labels(comms) -> str:
    """'all_reduce(tp) x2, all_gather(tp, bwd)': collectives counted by kind, first seen first."""
    n = Counter(comm_label(c) for c in comms)
    return ", ".join(k if v == 1 else f"{k} x{v}" for k, v in n.items())


def op_cell(row) -> str:
    """'· add_tensor_1 (add)'; 'bucket 3 (8 params)' and 'output' already say what they are."""
    return f"· {row.node}" if row.node.split(" ")[0] == row.op else f"· {row.node} ({row.op})"


def _sig(item) -> tuple:
    if isinstance(item, Row):
        return (item.op, item.layout, tuple((comm_label(c), c.bytes) for c in item.comms))
    return (item.name, item.signature())


def module_tree(plan, comms=None) -> ModuleNode:
    """The root (path ''): the model's modules, then the pseudo-modules; blocks folded."""
    root = ModuleNode("", "")
    nodes = {"": root}
    for row in plan_rows(plan, comms):
        module = row.module
        if module in PSEUDO:
            _child(root, nodes, module, module).items.append(row)
        elif module:
            _node(root, nodes, module).items.append(row)
        else:
            _child(root, nodes, TOP, TOP).items.append(row)
    for fqn, spec in plan.param_specs.items():
        owner, _, leaf = fqn.rpartition(".")
        if owner in nodes and owner not in PSEUDO:
            nodes[owner].params.append((leaf, fmt_spec(spec)))
    _move_last(root, (TOP, *PSEUDO))
    fold_blocks(root)
    if plan.stage_layout is not None:
        _say_stage_once(root, ())
    return root


def _say_stage_once(node: ModuleNode, above: tuple) -> None:
    """Mark the highest nodes that run on one stage with it (their parent spans several, or
    says another), so that a stage is said once per branch, not on every op."""
    mine = node.stages()
    if len(mine) == 1 and mine != above and node.path:
        node.stage_text = f", stage {mine[0]}"
    for c in node.children():
        _say_stage_once(c, mine if len(mine) == 1 else above)


def _node(root, nodes, path: str) -> ModuleNode:
    if path not in nodes:
        parent, _, name = path.rpartition(".")
        return _child(_node(root, nodes, parent) if parent else root, nodes, path, name)
    return nodes[path]


def _child(parent, nodes, path: str, name: str) -> ModuleNode:
    if path not in nodes:
        nodes[path] = ModuleNode(name, path)
        parent.items.append(nodes[path])
    return nodes[path]


def _move_last(root, names) -> None:
    """The pseudo-modules after the model's modules, whatever op reached them first."""
    last = [i for i in root.items if isinstance(i, ModuleNode) and i.name in names]
    root.items = [i for i in root.items if not any(i is x for x in last)] + last


def fold_blocks(node: ModuleNode) -> None:
    """Fold identical numbered sub-modules, innermost first. Blocks fold by their plan, wherever
    they stand: alternating layers (sliding and global attention, dense and MoE) give two
    folds, 'layers.0-30 step 2' and 'layers.1-31 step 2', each shown where its first block is.
    Every fold after a list's first says how it differs from the first. A module holding only
    numbered blocks (a ModuleList) gives its place to them ('layers.0-31')."""
    for c in node.children():
        fold_blocks(c)
    groups: dict = {}  # signature -> the blocks with that plan, in order
    for item in node.items:
        if isinstance(item, ModuleNode) and item.name.isdigit():
            groups.setdefault(item.signature(), []).append(item)
    folds = {id(blocks[0]): _fold(blocks) for blocks in groups.values()}
    first = next(iter(folds.values()), None)
    for f in folds.values():
        if f is not first:
            f.differs = _first_difference(first, f)
    out = []
    for item in node.items:
        if not (isinstance(item, ModuleNode) and item.name.isdigit()):
            out.append(item)
        elif id(item) in folds:
            out.append(folds[id(item)])
    node.items = [_lift(i) for i in out]


def _fold(blocks: list[ModuleNode]) -> ModuleNode:
    first = blocks[0]
    if len(blocks) == 1:
        return first
    name = index_text([int(b.name) for b in blocks])
    return ModuleNode(name, first.path, first.items, first.params, tuple(b.path for b in blocks))


def index_text(idx: list[int]) -> str:
    """'0-31', '1,3-5', '0-30 step 2': block numbers, short."""
    step = idx[1] - idx[0] if len(idx) > 1 else 1
    if len(idx) > 3 and step > 1 and all(b - a == step for a, b in zip(idx, idx[1:])):
        return f"{idx[0]}-{idx[-1]} step {step}"
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _lift(item):
    """A ModuleList's only children are its blocks: show 'layers.0-31' instead of 'layers' > '0-31'."""
    if not isinstance(item, ModuleNode) or item.rows() or item.params:
        return item
    kids = item.children()
    if len(kids) != 1 or not kids[0].name[:1].isdigit():
        return item
    only = kids[0]
    only.name = f"{item.name}.{only.name}"
    return only


def _flat(node: ModuleNode, prefix: str = "") -> list[str]:
    lines = [f"{prefix or '(block)'}: {k} {v}" for k, v in node.params]
    for i in node.items:
        if isinstance(i, Row):
            comm = ", ".join(comm_label(c) + f" {fmt_bytes(c.bytes)}" for c in i.comms)
            lines.append(f"{prefix or '(block)'}: {i.op} {i.layout} {comm}".rstrip())
        else:
            lines += _flat(i, f"{prefix}.{i.name}" if prefix else i.name)
    return lines


def _first_difference(before: ModuleNode, block: ModuleNode) -> str:
    here, there = block.stages(), before.stages()
    if here != there:  # another pipeline stage: what the reader needs first
        return f"differs from {before.name}: runs on {_stage_words(here)}, {before.name} on {_stage_words(there)}"
    a, b = _flat(before), _flat(block)
    for x, y in zip(a, b):
        if x != y:
            where, here = y.split(": ", 1)
            return f"differs from {before.name} first at {where}: {here}, there {x.split(': ', 1)[1]}"
    return f"differs from {before.name}: {len(b)} ops and parameters here, {len(a)} there"


def _stage_words(stages: tuple) -> str:
    return "stage " + ",".join(map(str, stages)) if stages else "no stage"
