"""What each mesh axis can do, and the parts of the model whose layout the search chooses.

Axis roles (one per mesh axis, see ``Structure`` and ``structures``): ``tp`` (Megatron tensor
parallel: the column/row pairs, optionally the vocabulary and sequence parallel: ``tp+sp``), the
roles the registered techniques give (``Technique.search_roles``: ``dp`` / ``rep``, the batch
split over one axis or two adjacent ones, the storages its options; ``pp``, pipeline stages;
``cp`` / ``cp_inner``, context parallel) and ``R`` (no role: every rank of the axis computes the
same). At most one of each but dp.

Components are what the search decides layer by layer on the tp axis: each Megatron pair
(found from the graph by presets.megatron's analysis) and the vocabulary (word embedding,
LM head and the loss after it). A component is split or replicated. A mixture-of-experts
model's experts modules are a component of the dp axis: expert parallel there (``ep``: each
rank holds E/n experts, tokens dispatched by all-to-all) or not (``local``: every expert on
each rank, run on its own tokens); the tokens are batch-split on both sides either way, so the
choice is additive like the others. Its key is its module
path with block numbers replaced by ``*`` ("model.layers.*.mlp"): every block of a repeated
stack shares one decision, so the problem does not grow with depth. Between components the
activations are replicated on tp (Megatron's pairs begin at a replicated input and end in a
reduction to replicated), so the cost of a component's choice does not depend on another's:
a step's cost is the sum of the components' costs plus the rest (``base``). With sequence
parallelism the boundaries are split on the sequence instead, and then every component is
split (a replicated pair there would need gathers the probes do not measure).

Example:
    >>> comps = components(model, traced)
    >>> [c.key for c in comps]                     # ['blocks.*.attn', 'blocks.*.mlp', 'vocab']
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from autopar.parallel.registry import TECHNIQUES
from autopar.sharding.annotations import colwise, rowwise, sequence_parallel, vocab_parallel
from autopar.placement import Shard
from autopar.presets.megatron_plan import _Graph
from autopar.trace.graph_walk import ancestors, descendants
from autopar.trace.module_paths import module_path

CHOICES = ("split", "R")


def pattern(path: str) -> str:
    """'model.layers.5.mlp.up_proj' -> 'model.layers.*.mlp.up_proj'."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path)


@dataclass
class Component:
    key: str
    kind: str  # "pair" | "vocab" | "experts"
    cols: dict = field(default_factory=dict)  # pattern -> blocks (pair: column-parallel layers)
    rows: set = field(default_factory=set)  # patterns (pair: row-parallel layers)
    embedding: str | None = None  # pattern (vocab)
    heads: set = field(default_factory=set)  # patterns (vocab)
    nodes: set = field(default_factory=set)  # node names of every instance (its region)
    params: set = field(default_factory=set)  # parameter names of every instance
    instances: int = 0
    module: str | None = None  # pattern (experts: the module holding the stacked expert weights)
    experts: int = 0  # experts: how many

    @property
    def patterns(self) -> list[str]:
        """The module patterns the component's choice annotates."""
        return [*self.cols, *self.rows, *([self.embedding] if self.embedding else []), *self.heads] + (
            [self.module] if self.module else []
        )

    def annotations(self, axis: str, sp: bool, tp: str | None = None) -> dict:
        """The annotations of the split choice on ``axis`` (experts: expert parallel there, the
        axis that splits the batch, each expert split over ``tp`` where given)."""
        if self.kind == "experts":
            return {self.module: experts_technique().annotation(axis, tp=tp)}
        out_sp = Shard(1) if sp else None
        if self.kind == "vocab":
            ann = {h: vocab_parallel(axis) for h in self.heads}
            if self.embedding:
                ann[self.embedding] = vocab_parallel(axis, output=out_sp) if sp else vocab_parallel(axis)
            return ann
        ann = {c: (colwise(axis, blocks=k) if k > 1 else colwise(axis)) for c, k in self.cols.items()}
        ann.update({r: (rowwise(axis, output=out_sp) if sp else rowwise(axis)) for r in self.rows})
        return ann

    def describe(self) -> str:
        if self.kind == "experts":
            return f"experts {self.module} ({self.experts} per layer, {self.instances}x): expert parallel on dp or not"
        if self.kind == "vocab":
            return f"vocabulary: embedding {self.embedding}, head {', '.join(sorted(self.heads)) or '-'}"
        return f"pair {', '.join(sorted(self.cols))} -> {', '.join(sorted(self.rows))} ({self.instances}x)"


def components(model, traced) -> tuple[list[Component], list[str]]:
    """The model's components and its norm patterns (sequence parallel), from the traced graph."""
    g = _Graph(model, traced)
    nodes = list(traced.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    linears = g.linears()
    by_path: dict[str, set] = {}  # module path -> its call_function nodes' names (one pass, not one per pair)
    for n in nodes:
        if n.op == "call_function":
            by_path.setdefault(module_path(n), set()).add(n.name)
    by_key: dict[str, Component] = {}
    splitter = experts_technique()  # the technique splitting MoE experts modules: what it would split
    moe = splitter.modules_of(model, traced) if splitter is not None else {}
    for row, cols in g.pairs():
        if any(x.startswith(p + ".") for p in moe for x in [row, *cols]):
            continue  # a per-expert ModuleList's own linears: the list is split whole, by expert
        key = pattern(_common(row, *cols))
        comp = by_key.setdefault(key, Component(key, "pair"))
        for c in cols:
            comp.cols[pattern(c)] = g.blocks(c)
        comp.rows.add(pattern(row))
        comp.instances += 1
        comp.nodes |= _region([linears[c] for c in cols], linears[row], index, {row, *cols}, by_path)
        comp.params |= _params_of(model, [row, *cols])
    comps = list(by_key.values())
    emb = g.word_embedding()
    if emb is not None:
        heads = [
            h for h in g.heads(emb[1], emb[0]) if not any(pattern(h) in c.cols or pattern(h) in c.rows for c in comps)
        ]
        comp = Component("vocab", "vocab", embedding=pattern(emb[0]), heads={pattern(h) for h in heads}, instances=1)
        own = {emb[0], *heads}
        comp.nodes = {n.name for n in nodes if module_path(n) in own}
        for h in heads:
            comp.nodes |= _downstream(linears[h], index)
        comp.params = _params_of(model, own)
        comps.append(comp)
    for path, n_experts in moe.items():
        key = pattern(path)
        comp = by_key.get(key) or Component(key, "experts", module=key, experts=n_experts)
        if comp.kind != "experts":
            continue  # a pair's region holds it: the pair decides (it should not happen)
        by_key[key] = comp
        if comp not in comps:
            comps.append(comp)
        comp.instances += 1
        comp.nodes |= {name for p, names in by_path.items() if p == path or p.startswith(path + ".") for name in names}
        comp.params |= _params_of(model, [path])
    taken = set()
    for c in comps:  # a node in two regions (it should not happen) counts for the first
        c.nodes -= taken
        taken |= c.nodes
    norms = sorted({pattern(p) for p in g.norms()}) if emb is not None else []
    return comps, norms


def _common(*paths: str) -> str:
    parts = [p.split(".") for p in paths]
    out = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        out.append(level[0])
    return ".".join(out) or "+".join(sorted(paths))


def _region(col_nodes, row_node, index, paths, by_path) -> set:
    """Node names between the column layers' matmuls and the row layer's (inclusive), plus
    the nodes of the layers themselves (bias adds, views; ``by_path``: module path -> node
    names): what the pair's split changes."""
    lo, hi = min(index[c] for c in col_nodes), index[row_node]
    fwd = set(col_nodes) | descendants(col_nodes, lambda u: index.get(u, hi + 1) <= hi)
    back = ancestors([row_node], lambda a: index.get(a, -1) >= lo)
    out = {n.name for n in fwd & back}
    for p in paths:
        out |= by_path.get(p, set())
    return out


def _downstream(node, index) -> set:
    seen = {node} | descendants([node], lambda u: u.op == "call_function")
    return {n.name for n in seen}


def _params_of(model, paths) -> set:
    out = set()
    for p in paths:
        out |= {f"{p}.{n}" for n, _ in model.get_submodule(p).named_parameters()}
    return out


@dataclass(frozen=True)
class Structure:
    """What each mesh axis does: ``{axis index: role}`` (``assignment``, sorted pairs), and the
    context-parallel choice where an axis has its role (its method and order). Roles: ``tp`` and
    ``tp+sp`` (Megatron tensor parallel, with sequence parallel: the layouts' own, the search's
    components) and the techniques' (``Technique.search_roles``: data parallel's ``dp`` and
    ``rep``, the axis right before dp over which the batch is split too; the pipeline's ``pp``;
    context parallel's ``cp`` and hybrid's ``cp_inner``, Ulysses within the axis right after cp).
    An axis without a role is replicated. The properties name the axis of each role (None without
    one), as the probes and the labels read them.

    Example:
        >>> s = Structure.of({0: "dp", 1: "tp+sp"})
        >>> s.dp, s.tp, s.sp, s.roles(ap.Mesh((2, 2), ("a", "b")))       # (0, 1, True, 'a=dp, b=tp+sp')
    """

    assignment: tuple = ()  # ((axis index, role), ...) by axis
    context: object = None  # the context-parallel technique (cp / cp_inner axes)

    @classmethod
    def of(cls, roles: dict, context=None) -> "Structure":
        return cls(tuple(sorted(roles.items())), context)

    def axis(self, *roles: str) -> int | None:
        """The axis holding one of ``roles`` (None where none does)."""
        return next((a for a, r in self.assignment if r in roles), None)

    def role(self, axis: int) -> str | None:
        return next((r for a, r in self.assignment if a == axis), None)

    @cached_property
    def dp(self) -> int | None:
        return self.axis("dp")

    @cached_property
    def rep(self) -> int | None:
        return self.axis("rep")

    @cached_property
    def tp(self) -> int | None:
        return self.axis("tp", "tp+sp")

    @cached_property
    def sp(self) -> bool:
        return self.axis("tp+sp") is not None

    @cached_property
    def pp(self) -> int | None:
        return self.axis("pp")

    @cached_property
    def cp(self) -> int | None:
        return self.axis("cp")

    @cached_property
    def cp_inner(self) -> int | None:
        return self.axis("cp_inner")

    @property
    def cp_method(self):
        return None if self.context is None else self.context.method

    @property
    def cp_balanced(self) -> bool:
        return False if self.context is None else self.context.load_balance

    def without_tp(self) -> "Structure":
        """The same structure with its tp axis replicated (a tp axis that split nothing)."""
        return Structure(tuple((a, r) for a, r in self.assignment if r not in ("tp", "tp+sp")), self.context)

    def roles(self, mesh) -> str:
        shown = {"rep": "dp", "cp_inner": "cp"}
        return ", ".join(f"{n}={shown.get(self.role(a), self.role(a) or 'R')}" for a, n in enumerate(mesh.axis_names))

    def uses(self, axis: int) -> bool:
        return self.role(axis) is not None

    def context_parallel(self, mesh):
        """The ap.ContextParallel of this structure (None without a cp axis)."""
        return self.context

    def can_fold(self) -> bool:
        """Whether ZeRO may fold this structure's cp axis into its shard group: the axis right
        after the dp axis (a shard group's ranks dp-major, DataParallel's rule), or any cp axis
        without data parallel."""
        if self.cp_inner is not None:
            return False  # hybrid's two axes are planned as one merged axis: not folded (untried)
        return self.cp is not None and (self.dp is None or self.cp == self.dp + 1)


def experts_technique():
    """The registered technique that splits mixture-of-experts modules over the dp axis (it offers
    ``modules_of(model, traced)`` and their ``annotation(axis, tp=)``), or None."""
    return next((cls for cls in TECHNIQUES.values() if hasattr(cls, "modules_of")), None)


def technique_of(role: str):
    """The registered technique that gives mesh axes ``role`` (Technique.search_roles), or None."""
    return next((cls for cls in TECHNIQUES.values() if role in cls.search_roles), None)


def structures(
    mesh,
    allow_sp: bool,
    fixed_dp: int | None,
    fixed_tp: int | None,
    any_dp: bool,
    allow_pp: bool = True,
    cp_methods: tuple = (),
    balanced=lambda n: False,
) -> list[Structure]:
    """Every assignment of roles to axes (one dp axis or two adjacent ones, at most one tp, at
    most one pipeline axis, at most one context-parallel axis, by each of ``cp_methods``,
    zig-zag ordered where ``balanced(axis size)``: the context-parallel technique's
    ``search_choices``) that the constraints allow. Context parallel is not combined with
    pipeline stages nor with sequence parallel (neither pairing has been run against serial)."""
    out = []
    axes = [None, *range(mesh.ndim)]
    cp_technique = technique_of("cp")
    for dp in axes:
        if (fixed_dp is not None and dp != fixed_dp) or (not any_dp and dp is not None and fixed_dp is None):
            continue
        reps = [None] + (
            [dp - 1] if dp is not None and dp > 0 and mesh.shape[dp - 1] > 1 and mesh.shape[dp] > 1 else []
        )
        for rep in reps:
            for tp in axes:
                if tp is not None and tp in (dp, rep):
                    continue
                if fixed_tp is not None and tp != fixed_tp:
                    continue
                for sp in (False, True) if tp is not None and allow_sp else (False,):
                    roles = {
                        a: r for a, r in ((dp, "dp"), (rep, "rep"), (tp, "tp+sp" if sp else "tp")) if a is not None
                    }
                    free = [a for a in range(mesh.ndim) if mesh.shape[a] > 1 and a not in roles]
                    for pp in [None] + (free if allow_pp else []):
                        out.append(Structure.of({**roles, **({pp: "pp"} if pp is not None else {})}))
                    if sp or cp_technique is None:
                        continue
                    for cp in cp_technique.search_choices(mesh, free, cp_methods, balanced):
                        out.append(Structure.of({**roles, **cp.search_axes(mesh)}, cp))
    return out


def sp_annotations(norms: list[str], axis: str) -> dict:
    return {n: sequence_parallel(axis) for n in norms}
