"""Trace a deep model fast: export two of its identical blocks, then copy the second one.

torch.export costs about a third of a second per transformer block with dynamic shapes, so
a 48-layer GPT took 11-14 s to trace. Deep models are a ModuleList (or torchtitan's ModuleDict
keyed "0", "1", ...) of blocks that are the same module with other weights; exporting the model
with only its first two blocks and repeating block 1's subgraph for blocks 2..n-1 gives the
graph a full export gives, at the cost of a 2-block export.

It is done only when it is safe to assume that every block computes what block 1 does:

- the list's children have the same type, parameter and buffer shapes, module tree and
  plain attributes (a per-block attribute such as ``sliding_window`` or ``attention_type``
  stops it; only a position number such as ``layer_idx`` may differ), no hooks, and no
  parameter shared with another block or the rest of the model;
- in the 2-block graph, blocks 0 and 1 are consecutive and op for op the same (constants
  included) with block 1 reading block 0's outputs where block 0 read its inputs, and
  nothing after block 1 reads block 0.

Anything else (the forward indexes the list with ``range(n_layers)``, uses ``len`` of it,
or a check fails) falls back to exporting the whole model. ``ap.plan(...,
repeat_blocks=False)`` turns it off.

Example:
    >>> found = find_repeated(model)               # ("blocks", 48) for a 48-layer GPT
    >>> with truncated(model, found): ep = torch.export.export(model, args)
    >>> copy_blocks(traced, found)                 # traced: the 2-block graph -> 48 blocks
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

MIN_BLOCKS = 4  # below this, a 2-block export saves little
POSITION_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "block_idx"})


@dataclass(frozen=True)
class Repeated:
    """A list of ``count`` identical blocks at module path ``prefix``."""

    prefix: str
    count: int


STACKS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_repeated(model: nn.Module, min_blocks: int = MIN_BLOCKS) -> Repeated | None:
    """The longest ModuleList / Sequential / ModuleDict of identical blocks in ``model``, if any.

    A ModuleDict counts when its keys are the positions "0", "1", ... in order: torchtitan keeps
    its layers so (``layers[str(layer_id)]``, so that a pipeline stage keeps the others' names),
    and its paths (``layers.3``) are then a list's.
    """
    shared = _shared_parameter_ids(model)
    best = None
    for path, mod in model.named_modules():
        if not path or type(mod) not in STACKS or len(mod) < min_blocks:
            continue
        kids = [m for _, m in mod.named_children()]
        if [n for n, _ in mod.named_children()] != [str(i) for i in range(len(kids))]:
            continue
        if _identical(kids, shared) and (best is None or len(kids) > best.count):
            best = Repeated(path, len(kids))
    return best


@contextlib.contextmanager
def truncated(model: nn.Module, found: Repeated):
    """``model`` with only the first two blocks of ``found`` while inside the block.

    The short list still reports the full length: ``len(self.blocks)`` in the forward gives
    the model's depth, and indexing a block past the second fails (and the caller exports
    the whole model) rather than silently reading another block.
    """
    parent_path, _, name = found.prefix.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = getattr(parent, name)
    short = _SHORT[type(full)]()
    short._full_len = len(full)
    for i, (_, block) in enumerate(list(full.named_children())[:2]):
        short.add_module(str(i), block)
    short.train(full.training)
    setattr(parent, name, short)
    try:
        yield
    finally:
        setattr(parent, name, full)


class _FirstTwoList(nn.ModuleList):
    _full_len = 0

    def __len__(self):
        return self._full_len


class _FirstTwoSequential(nn.Sequential):
    _full_len = 0

    def __len__(self):
        return self._full_len


class _FirstTwoDict(nn.ModuleDict):
    """``values()`` / ``items()`` walk the two blocks; ``self.layers["5"]`` fails (KeyError)."""

    _full_len = 0

    def __len__(self):
        return self._full_len


_SHORT = {nn.ModuleList: _FirstTwoList, nn.Sequential: _FirstTwoSequential, nn.ModuleDict: _FirstTwoDict}


def copy_blocks(traced, found: Repeated) -> bool:
    """Grow the 2-block graph of ``traced`` to ``found.count`` blocks, in place.

    Returns False (the graph untouched) when the graph does not have the expected shape;
    the caller then exports the whole model.
    """
    shape = _two_blocks(traced, found.prefix)
    if shape is None:
        return False
    graph = traced.gm.graph
    b1, to_b1, carried_from, par = shape
    anchors = _placeholder_anchors(traced, par)
    prev = {n: n for n in b1}  # block 1 node -> the same node in the block before the one being made
    copies: set[fx.Node] = set()
    tail = b1[-1].next  # blocks 2.. go between block 1 and the rest, in order
    for k in range(2, found.count):
        params = _new_placeholders(traced, found.prefix, k, par, anchors)
        made: dict[fx.Node, fx.Node] = {}

        def arg(a, made=made, params=params, prev=prev):
            if a in made:
                return made[a]
            if a in params:
                return params[a]
            if a in carried_from:  # a block-0 value block 1 reads: the previous block's
                return prev[to_b1[a]]
            return a

        with graph.inserting_before(tail):
            for node in b1:
                new = graph.create_node(
                    node.op, node.target, fx.map_arg(node.args, arg), fx.map_arg(node.kwargs, arg), type_expr=node.type
                )
                new.meta = _renumbered(node.meta, found.prefix, k)
                made[node] = new
        copies.update(made.values())
        prev = made
    block1 = set(b1)
    for user in {u for n in b1 for u in n.users if u not in block1 and u not in copies}:
        user.args = fx.map_arg(user.args, lambda a: prev.get(a, a))
        user.kwargs = fx.map_arg(user.kwargs, lambda a: prev.get(a, a))
    graph.lint()
    return True


# ------------------------------------------------------------------------ the blocks
def _shared_parameter_ids(model) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, c in seen.items() if c > 1}


def _identical(kids: list[nn.Module], shared: set[int]) -> bool:
    if len({type(k) for k in kids}) != 1 or len({id(k) for k in kids}) != len(kids):
        return False
    if any(id(p) in shared for k in kids for p in k.parameters()):
        return False
    first = _signature(kids[0])
    return first is not None and all(_signature(k) == first for k in kids[1:])


def _signature(block: nn.Module):
    """What must be equal for two blocks to compute the same function of their weights."""
    out = []
    for name, m in block.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None):
            return None
        attrs = []
        for key, value in sorted(vars(m).items()):
            if key.startswith("_") or key == "training" or key in POSITION_ATTRS:
                continue
            if isinstance(value, torch.Tensor):
                return None  # a plain tensor attribute: may differ from block to block
            attrs.append((key, _Same(value)))
        params = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False)]
        bufs = [
            (n, tuple(b.shape), b.dtype, n in m._non_persistent_buffers_set) for n, b in m.named_buffers(recurse=False)
        ]
        out.append((name, type(m), tuple(attrs), tuple(params), tuple(bufs)))
    return tuple(out)


class _Same:
    """Equality of plain attributes: ==, or the same object where == is not a bool."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        a, b = self.value, other.value
        if a is b:
            return True
        try:
            eq = a == b
        except Exception:  # noqa: BLE001 - objects whose == raises are simply not the same
            return False
        return eq is True or (isinstance(eq, bool) and eq)

    __hash__ = None


# ---------------------------------------------------------------------- the 2-block graph
def _block_index(node: fx.Node, prefix: str) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path.startswith(prefix + "."):
            head = path[len(prefix) + 1 :].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _two_blocks(traced, prefix: str):
    """(block 1's nodes, block 0 -> block 1 node map, block-0 values block 1 reads,
    block 1's placeholders by their name within the block), or None."""
    nodes = list(traced.gm.graph.nodes)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    where = [_block_index(n, prefix) for n in body]
    if any(b not in (None, 0, 1) for b in where):
        return None
    pos0 = [i for i, b in enumerate(where) if b == 0]
    pos1 = [i for i, b in enumerate(where) if b == 1]
    if (
        not pos0
        or len(pos0) != len(pos1)
        or pos0 != list(range(pos0[0], pos0[-1] + 1))
        or pos1 != list(range(pos0[-1] + 1, pos0[-1] + 1 + len(pos0)))
    ):
        return None  # not two consecutive runs of the same length
    b0, b1 = [body[i] for i in pos0], [body[i] for i in pos1]
    par0, par1 = _block_placeholders(traced, nodes, prefix, 0), _block_placeholders(traced, nodes, prefix, 1)
    if set(par0) != set(par1):
        return None
    iso = _Iso(set(b0), {v: k for k, v in par0.items()}, par1)
    for n0, n1 in zip(b0, b1):
        if (
            n0.op != n1.op
            or n0.target != n1.target
            or not iso.same(n0.args, n1.args)
            or not iso.same(n0.kwargs, n1.kwargs)
        ):
            return None
        iso.map[n0] = n1
    b0_set, b1_set = set(b0), set(b1)
    for n in body[pos1[-1] + 1 :] + [nodes[-1]]:  # after block 1: nothing reads block 0
        if any(a in b0_set for a in n.all_input_nodes):
            return None
    if any(u not in b1_set for n in b0 for u in n.users if u not in b0_set):
        return None
    carried_from = set(iso.carried.values())
    by_name1 = {node: name for name, node in par1.items()}
    return b1, iso.map, carried_from, by_name1


def _block_placeholders(traced, nodes, prefix: str, k: int) -> dict[str, fx.Node]:
    """Placeholders of block ``k``'s parameters and buffers, by their name inside the block."""
    head = f"{prefix}.{k}."
    out = {}
    for n in nodes:
        if n.op != "placeholder":
            continue
        fqn = traced.param_fqn.get(n.name) or traced.buffer_fqn.get(n.name) or traced.constant_fqn.get(n.name)
        if fqn and fqn.startswith(head):
            out[fqn[len(head) :]] = n
    return out


class _Iso:
    """Checks block 1 is block 0 op for op; learns which block-0 values block 1 reads."""

    def __init__(self, b0: set, par0_names: dict, par1: dict):
        self.b0, self.par0_names, self.par1 = b0, par0_names, par1
        self.map: dict[fx.Node, fx.Node] = {}
        self.carried: dict[fx.Node, fx.Node] = {}  # block 0's input -> block-0 value in its place

    def same(self, a0, a1) -> bool:
        if isinstance(a0, fx.Node):
            if not isinstance(a1, fx.Node):
                return False
            if a0 in self.map:
                return self.map[a0] is a1
            if a0 in self.par0_names:
                return self.par1.get(self.par0_names[a0]) is a1
            if a1 is a0:
                return True  # both blocks read the same outside value (a mask, rotary tables)
            if a1 in self.b0:  # block 1 reads block 0's output where block 0 read its input
                return self.carried.setdefault(a0, a1) is a1
            return False
        if isinstance(a0, (list, tuple)):
            return type(a0) is type(a1) and len(a0) == len(a1) and all(map(self.same, a0, a1))
        if isinstance(a0, dict):
            return isinstance(a1, dict) and a0.keys() == a1.keys() and all(self.same(a0[k], a1[k]) for k in a0)
        if isinstance(a0, float) and math.isnan(a0):
            return isinstance(a1, float) and math.isnan(a1)
        return type(a0) is type(a1) and a0 == a1


# ------------------------------------------------------------------------- copying
def _kind_table(traced, node: fx.Node) -> dict:
    return next(t for t in (traced.param_fqn, traced.buffer_fqn, traced.constant_fqn) if node.name in t)


def _placeholder_anchors(traced, par1_names: dict) -> dict[int, fx.Node]:
    """Per kind of placeholder (parameter, buffer), block 1's last one: block 2's go after it,
    block 3's after block 2's, ..., which keeps export's order."""
    anchors = {}
    for n in traced.gm.graph.nodes:  # graph order: the last one seen wins
        if n in par1_names:
            anchors[id(_kind_table(traced, n))] = n
    return anchors


def _new_placeholders(traced, prefix: str, k: int, par1_names: dict, anchors: dict) -> dict[fx.Node, fx.Node]:
    """Placeholders for block ``k``'s weights, after block k-1's, named as export names them."""
    graph = traced.gm.graph
    out = {}
    for old, rel in par1_names.items():
        fqn1, fqnk = f"{prefix}.1.{rel}", f"{prefix}.{k}.{rel}"
        u1, uk = fqn1.replace(".", "_"), fqnk.replace(".", "_")
        if u1 not in old.name:  # export lower-cases names ("LayerNorm" -> "layernorm")
            u1, uk = u1.lower(), uk.lower()
        name = old.name.replace(u1, uk) if u1 in old.name else f"{old.name}_{k}"
        table = _kind_table(traced, old)
        with graph.inserting_after(anchors[id(table)]):
            new = graph.placeholder(name, type_expr=old.type)
        anchors[id(table)] = new
        new.meta = dict(old.meta)
        table[new.name] = fqnk
        out[old] = new
    return out


def _renumbered(meta: dict, prefix: str, k: int) -> dict:
    """A copy of block 1's node meta, with module paths naming block ``k``."""
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        one, new = f"{prefix}.1", f"{prefix}.{k}"
        fresh = {}
        for key, (path, cls) in stack.items():
            if path == one or path.startswith(one + "."):
                npath = new + path[len(one) :]
                key = key[: len(key) - len(path)] + npath if key.endswith(path) else f"{key}@{k}"
                path = npath
            fresh[key] = (path, cls)
        out["nn_module_stack"] = fresh
    return out
