"""Annotation presets found from a model's traced graph: ``presets.megatron(model)``.

The Megatron plan pairs a column-parallel layer with a row-parallel one wherever the
first feeds the second without a normalisation or the residual stream in between: the
attention's q/k/v projections with its output projection, an MLP's up (and gate) with
its down projection. The pairs are found from data flow, not from module names: walking
back from each linear layer's input, we stop at linear layers; if every path ends at
linear layers or at inputs that carry no parameter (masks, positions, rotary tables),
the layer is row-parallel and the linears reached are column-parallel. A path that
meets any other parameter (a norm's weight, an embedding) or a floating-point model input
means the layer reads the residual stream: it stays replicated. A column-parallel layer whose output is split into
k equal pieces (GPT-2's fused q|k|v) is split block by block (colwise(blocks=k)).
The word embedding (the embedding of a user input with the most rows) and an LM head
(a linear with as many outputs as that vocabulary, or tied to it) become vocab-parallel.
The experts of MoE blocks (the stacked 3-D weights of grouped expert matmuls) are split over the
axis by expert: ``expert_parallel(axis)``, as the registered expert-parallel technique finds and
annotates them (``ap.ExpertParallel.modules_of`` / ``.annotation``: the preset is a composition of
public techniques and names none of their folders).
With ``sequence_parallel=True`` the norms run split on the sequence dim, row-parallel
layers reduce-scatter into it and the embedding's output is reduce-scattered.

Example:
    >>> ann = ap.presets.megatron(model, "tp", kwargs={"input_ids": ids})
    >>> print(ann.explain())
    >>> plan = ap.plan(model, mesh, kwargs={"input_ids": ids}, annotations=ann)
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from autopar.parallel import TECHNIQUES
from autopar.sharding.annotations import (
    _layer_kind,
    colwise,
    rowwise,
    sequence_parallel,
    vocab_parallel,
)
from autopar.errors import AnnotationError
from autopar.placement import Shard, piece_sizes
from autopar.trace.module_paths import module_path
from autopar.trace.export import trace

aten = torch.ops.aten
MATMULS = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.addmm.default}
WALK_DEPTH = 64  # _walked's nesting at most (each level two frames); deeper nodes are walked one by one
SIZE_ONLY = {
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.sym_size.int,
}
RESHAPES = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.alias.default,
}
TRANSPOSES = {aten.t.default, aten.numpy_T.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
PASS_THROUGH = {
    aten.view.default,
    aten.reshape.default,
    aten.add.Tensor,
    aten.alias.default,
    aten._unsafe_view.default,
    aten.contiguous.default,
}


class Preset(dict):
    """Annotations ({pattern: annotation}) plus ``matches``: why each one was chosen."""

    def __init__(self, annotations: dict, matches: list[str]):
        super().__init__(annotations)
        self.matches = matches

    def explain(self) -> str:
        return "\n".join(self.matches)


def megatron(
    model: torch.nn.Module,
    axis: str = "tp",
    *,
    args=(),
    kwargs=None,
    sequence_parallel: bool = False,
    vocab: bool = True,
    experts: bool = True,
    expert_axis: str | None = None,
    expert_tp: bool = False,
    size: int | None = None,
) -> Preset:
    """The Megatron tensor-parallel annotations for ``model`` on mesh axis ``axis``.

    ``args``/``kwargs`` are example inputs to trace with (default: the model's
    ``dummy_inputs``, as HuggingFace models have). With ``experts`` (the default), the
    experts of MoE blocks (modules whose stacked 3-D weights feed grouped expert matmuls)
    are split over ``axis`` too: ``expert_parallel(axis)``, each rank holds E/n experts.
    ``expert_axis`` puts them on another axis instead: on the data-parallel axis, tokens are
    dispatched to their experts' ranks by all-to-all (expert parallelism, docs/experts.md)
    while the dense layers stay tensor-parallel on ``axis``; with ``expert_tp`` each expert is
    split over ``axis`` too (expert tensor parallelism: ``expert_parallel(expert_axis, tp=axis)``).
    ``size``: the number of ranks on ``axis`` where known. Any size splits (uneven pieces, as
    torch.tensor_split cuts: a vocabulary of 50257 on 4 ranks is 12565, 12564, 12564, 12564 rows)
    and explain() says which splits are uneven; a fused layer whose blocks do not divide by it
    (q|k|v of 3 x 20 features on 3 ranks divides, on 8 does not) stays replicated with its pair.

    Example:
        >>> ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="dp")   # mesh ("dp", "tp")
    """
    if not args and not kwargs:
        kwargs = dict(getattr(model, "dummy_inputs", None) or {})
        if not kwargs:
            raise AnnotationError(
                f"presets.megatron({type(model).__name__}): pass example inputs "
                "(args=... or kwargs=...) to trace the model with."
            )
    traced = trace(model, args if isinstance(args, tuple) else (args,), kwargs, dynamic=False)
    g = _Graph(model, traced)
    ann, why = {}, []
    experts_technique = TECHNIQUES["expert_parallel"]  # ap.ExpertParallel, by its name
    moe = experts_technique.modules_of(model, traced) if experts else {}
    # the linears of a per-expert ModuleList belong to its experts (split whole, by expert)
    pairs = [(r, c) for r, c in g.pairs() if not any(x.startswith(p + ".") for p in moe for x in [r, *c])]
    if not pairs and not moe:
        raise AnnotationError(
            f"presets.megatron({type(model).__name__}): found no column/row-parallel "
            "pair of linear layers (a linear feeding another through attention or "
            "an activation); annotate with ap.colwise / ap.rowwise by hand."
        )
    sp_out = Shard(1) if sequence_parallel else None
    for row, cols in pairs:
        blocked = [
            (c, g.blocks(c)) for c in cols if size and g.blocks(c) > 1 and _blocks_uneven(model, c, g.blocks(c), size)
        ]
        if blocked:
            c, k = blocked[0]
            why.append(f"{row}, {', '.join(cols)}: left replicated, {c}'s {k} blocks do not divide by {axis}={size}")
            g.why_not.update({p: "its pair cannot split (blocks)" for p in [row, *cols]})
            continue
        for c in cols:
            k = g.blocks(c)
            ann[c] = colwise(axis, blocks=k) if k > 1 else colwise(axis)
            why.append(
                f"{c}: {ann[c]!r}, feeds {row}"
                + (f" (output split into {k} blocks)" if k > 1 else "")
                + _uneven_note(_rows(model, c, 0), size, axis)
            )
        ann[row] = rowwise(axis, output=sp_out) if sp_out else rowwise(axis)
        why.append(
            f"{row}: {ann[row]!r}, reads only {', '.join(cols)}" + _uneven_note(_rows(model, row, 1), size, axis)
        )
    if vocab:
        _vocab(g, ann, why, axis, sp_out, size)
    on = expert_axis or axis
    for path, count in moe.items():
        ann[path] = experts_technique.annotation(on, tp=axis if expert_tp and on != axis else None)
        how = (
            "a ModuleList of experts"
            if isinstance(model.get_submodule(path), torch.nn.ModuleList)
            else "grouped matmuls"
        )
        why.append(f"{path}: {ann[path]!r}, {count} experts run by {how}")
    for path in sorted(set(g.linears()) - set(ann)):
        why.append(f"{path}: left replicated, {g.why_not.get(path, 'not part of a column/row pair')}")
    if sequence_parallel:
        for path in g.norms():
            ann[path] = sequence_parallel_annotation(axis)
            why.append(f"{path}: sequence_parallel({axis!r}), a norm on the residual stream")
    return Preset(ann, why)


sequence_parallel_annotation = sequence_parallel


def _rows(model, path: str, dim: int) -> int | None:
    """The output (``dim`` 0) or input (1) features of the layer at ``path``: a Linear's weight is
    (out, in), HF's Conv1D (GPT-2) keeps (in, out); None where there is no weight."""
    try:
        mod = model.get_submodule(path)
        out = getattr(mod, "out_features", None) or getattr(mod, "nf", None)
        if dim == 0 and out is not None:
            return int(out)
        if dim == 1 and getattr(mod, "in_features", None) is not None:
            return int(mod.in_features)
        shape = mod.weight.shape
        return int(shape[1 - dim] if getattr(mod, "nf", None) is not None else shape[dim])
    except (AttributeError, IndexError, TypeError):
        return None


def _blocks_uneven(model, path: str, blocks: int, size: int) -> bool:
    """Whether each of the ``blocks`` output blocks of the layer at ``path`` fails to divide by ``size``."""
    rows = _rows(model, path, 0)
    return rows is not None and (rows // blocks) % size != 0


def _uneven_note(rows, size, axis) -> str:
    """', uneven: 50257 rows on tp=4 are 12565, 12564, ...' where ``rows`` does not divide by ``size``."""
    if not size or rows is None or rows % size == 0:
        return ""
    pieces = piece_sizes(rows, size)
    return f"; uneven: {rows} on {axis}={size} are pieces {', '.join(map(str, pieces))}"


def _vocab(g, ann, why, axis, sp_out, size=None) -> None:
    emb = g.word_embedding()
    if emb is None:
        return
    path, rows = emb
    ann[path] = vocab_parallel(axis, output=sp_out) if sp_out else vocab_parallel(axis)
    note = _uneven_note(rows, size, axis)
    why.append(f"{path}: {ann[path]!r}, the word embedding ({rows} rows, looked up from an input){note}")
    paired = set(ann)
    for head in g.heads(rows, path):
        if head not in paired:
            ann[head] = vocab_parallel(axis)
            why.append(f"{head}: vocab_parallel({axis!r}), the LM head ({rows} outputs){note}")


class _Graph:
    """The traced graph with each parametrised layer's nodes."""

    def __init__(self, model, traced):
        self.model, self.traced = model, traced
        self.modules = dict(model.named_modules())
        self.params = set(traced.param_fqn)
        self.layer_of: dict[fx.Node, str] = {}  # matmul/embedding node -> module path
        self._linears = None
        self._walks: dict = {}  # node -> where the walk from it stops (_walked)
        self._depth = 0  # _walked's nesting
        for node in traced.gm.graph.nodes:
            path = self._weight_owner(node)
            if path is not None:
                self.layer_of[node] = path

    def _weight_owner(self, node):
        if node.op != "call_function" or node.target not in MATMULS | {aten.embedding.default}:
            return None
        for a in node.args[:3]:
            if isinstance(a, fx.Node) and a.op == "call_function" and a.target in TRANSPOSES:
                a = a.args[0]  # x @ w.T (Falcon's linears): the weight seen through its transpose
            if isinstance(a, fx.Node) and a.name in self.params:
                inner = module_path(node)  # a tied weight has one name: trust the calling module
                if isinstance(getattr(self.modules.get(inner), "weight", None), torch.nn.Parameter):
                    return inner
                path = self.traced.param_fqn[a.name].rpartition(".")[0]
                if isinstance(getattr(self.modules.get(path), "weight", None), torch.nn.Parameter):
                    return path  # a module with no weight (CpmAnt's position bias table) is no layer
        return None

    def _activation(self, node):
        return next((a for a in node.args if isinstance(a, fx.Node) and a.name not in self.params), None)

    def linears(self):
        if self._linears is None:  # layer_of is complete after __init__: computed once (a 405B has ~900)
            self._linears = {p: n for n, p in self.layer_of.items() if _layer_kind(self.modules[p]) != "embedding"}
        return self._linears

    def pairs(self) -> list[tuple[str, list[str]]]:
        out = []
        self.why_not: dict[str, str] = {}
        for path, node in self.linears().items():
            self.stop = "reads only parameter-free inputs"
            cols = self._reads(self._activation(node), path)
            if cols:
                out.append((path, sorted(cols)))
            else:
                self.why_not[path] = f"not row-parallel: its input {self.stop}; no row-parallel layer reads it"
        rows = {r for r, _ in out}  # a layer cannot be both: such a chain is not a Megatron pair
        for r, cols in out:
            if rows & set(cols):
                self.why_not[r] = f"both row-parallel (reads {', '.join(cols)}) and column-parallel: a chain"
        return [(r, cols) for r, cols in out if not rows & set(cols)]

    def _reads(self, start, own: str) -> set | None:
        """Linear layers reached walking back from ``start``; None if a parameter is met first
        (``self.stop`` says what)."""
        found, stop, _, _ = self._walk(start, own)
        if stop is not None:
            self.stop = stop
            return None
        return found or None

    def _walk(self, start, own: str | None) -> tuple:
        """(the layers found, the stop met first or None, every layer met, the parameter stopped
        at or None): the walk back from ``start`` for layer ``own`` (depth first, in the order
        the inputs are listed). A node earlier in the graph than every node walked so far has
        none of them upstream, so the rest of the walk from it is the walk that starts there:
        where that one stops (_walked), this one stops the same way."""
        found, met, seen, todo = set(), set(), set(), [start]
        low = None  # the graph position of the earliest node walked
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            at = self._position[node]
            if low is None or at < low:
                low = at
                known = self._walked(node, own) if node is not start else None
                if known is not None:
                    return found, known[0], met | known[1], known[2]
            seen.add(node)
            layer = self._layer_at.get(node)
            if layer is not None and layer != own:  # the layer's own nodes (a Conv1D's bias add, its views) count as it
                met.add(layer)
                if _layer_kind(self.modules[layer]) == "embedding":
                    if self._side_embedding(node):
                        continue  # T5's relative position bias: looked up from positions, not the residual stream
                    return found, f"reads the embedding {layer}", met, None
                found.add(layer)
                continue
            if node.op == "placeholder":
                val = node.meta.get("val")
                floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
                if node.name in self.params and self._per_head(val, own):
                    continue  # qk-norm (Qwen3, Gemma-3, OLMo-2): a norm weight over the head dim only
                if node.name in self.params or (floating and node.name in self.traced.user_inputs):
                    # a norm, an embedding or the input activations: the residual stream
                    stop = f"reads {self.traced.param_fqn.get(node.name, node.name)} (the residual stream)"
                    return found, stop, met, node if node.name in self.params else None
                continue
            if node.op != "call_function" or node.target in SIZE_ONLY:
                continue
            todo += [a for a in node.all_input_nodes]
        return found, None, met, None

    def _walked(self, node, own: str | None) -> tuple | None:
        """(the stop, the layers met, the parameter stopped at) of the walk from ``node`` for no
        layer, where it stops and a walk for ``own`` would stop the same way (it met no node of
        ``own``'s layer, and stopped at no qk-norm weight of it); else None. Kept per node: each
        linear of block k that reads the residual stream walked it back through blocks k-1 .. 0
        to the embedding (a 405B's 126 blocks: ~95,000 nodes walked for ~900 linears)."""
        if node not in self._walks:
            if self._depth >= WALK_DEPTH:
                return None  # not kept: walked node by node
            self._depth += 1
            try:
                _, stop, met, param = self._walk(node, None)
            finally:
                self._depth -= 1
            self._walks[node] = (stop, frozenset(met), param) if stop is not None else None
        known = self._walks[node]
        if known is None or own in known[1]:
            return None
        if known[2] is not None and self._per_head(known[2].meta.get("val"), own):
            return None
        return known

    @functools.cached_property
    def _position(self) -> dict:
        return {n: i for i, n in enumerate(self.traced.gm.graph.nodes)}

    def _per_head(self, val, own: str) -> bool:
        """A 1-D weight smaller than the layer's input: a norm over one head's dim (qk-norm)."""
        w = getattr(self.modules.get(own), "weight", None)
        return (
            isinstance(val, torch.Tensor)
            and val.dim() == 1
            and w is not None
            and w.dim() == 2
            and val.shape[0] < min(w.shape)
        )

    def _side_embedding(self, node) -> bool:
        """An embedding looked up from computed positions (no user input upstream)."""
        todo, seen = [node.args[1]] if node.target is aten.embedding.default else [], set()
        while todo:
            n = todo.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and n.name in self.traced.user_inputs:
                return False
            todo += n.all_input_nodes
        return node.target is aten.embedding.default

    def _inside_layer(self, node):
        path = module_path(node)
        return path if path in self._layer_paths else None

    @functools.cached_property
    def _layer_at(self) -> dict:
        """Node -> the layer it belongs to (its matmul's, or a node inside the layer's module),
        for every node that has one: read once per node, where ``_reads`` asked each node it
        walked (~100 per linear, ~95,000 module paths on a 126-block 405B)."""
        out = {}
        for node in self.traced.gm.graph.nodes:
            layer = self.layer_of.get(node) or self._inside_layer(node)
            if layer is not None:
                out[node] = layer
        return out

    @functools.cached_property
    def _layer_paths(self) -> set:
        return set(self.layer_of.values())  # read per node walked in _reads: built once

    def blocks(self, path: str) -> int:
        """k when the layer's output is split into k equal pieces on its last dim, else 1."""
        node = self.linears()[path]
        for _ in range(4):
            users = [u for u in node.users if u.op == "call_function"]
            split = next((u for u in users if u.target in SPLITS), None)
            if split is not None:
                outs = split.meta["val"]
                dim = split.args[2] if len(split.args) > 2 else 0
                last = dim % node.meta["val"].dim() == node.meta["val"].dim() - 1
                sizes = {o.shape[-1] for o in outs}
                return len(outs) if last and len(sizes) == 1 and len(outs) > 1 else 1
            nxt = [u for u in users if u.target in PASS_THROUGH]
            if len(nxt) != 1:
                return 1
            node = nxt[0]
        return 1

    def word_embedding(self):
        best = None
        for node, path in self.layer_of.items():
            if node.target is not aten.embedding.default:
                continue
            ids = node.args[1]
            while isinstance(ids, fx.Node) and ids.op == "call_function" and ids.target in RESHAPES:
                ids = ids.args[0]
            if isinstance(ids, fx.Node) and ids.op == "placeholder" and ids.name in self.traced.user_inputs:
                rows = self.modules[path].weight.shape[0]
                if best is None or rows > best[1]:
                    best = (path, rows)
        return best

    def heads(self, rows: int, emb_path: str) -> list[str]:
        emb_weight = self.modules[emb_path].weight
        out = []
        for path in self.linears():
            mod = self.modules[path]
            w = mod.weight
            features = w.shape[1] if _layer_kind(mod) == "conv1d" else w.shape[0]
            if w is emb_weight or features == rows:
                out.append(path)
        return out

    def norms(self) -> list[str]:
        """Modules (not linear, not embedding) whose parameters are all vectors: norms."""
        out = []
        for path, mod in self.modules.items():
            own = list(mod.parameters(recurse=False))
            if (
                path
                and own
                and all(p.dim() == 1 for p in own)
                and _layer_kind(mod) == "linear"
                and not hasattr(mod, "in_features")
                and path not in self.linears()
            ):
                out.append(path)
        return out


__all__ = ["megatron", "Preset"]
