"""Cut the planned graph into pipeline stages: where, what each holds, what crosses.

Stage boundaries come from ``ap.split_before()`` annotations on module paths, or from a
cost model: each node costs its FLOPs (forward + backward ~ 3x forward) plus the bytes of
the parameters it reads, and the cut points (at module boundaries: where the owning block,
e.g. ``blocks.3``, changes) are chosen by dynamic programming to minimise the most
expensive stage. A stage is a contiguous run of the graph's nodes in execution order;
parameters go to every stage that reads them (tied weights to several), user inputs are
fed to every stage that reads them, and every other value a stage reads from an earlier
stage is a boundary value: sent point to point, with its gradient sent back.

Example:
    >>> layout = split_stages(plan.traced, mesh, pipeline, cuts_at={"blocks.2"})
    >>> [s.index for s in layout.stages], layout.stages[1].recv
    ([0, 1], [('add_2', 0), ('sym_size_int_2', 0)])
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.cost.formulas import Numbers
from autopar.cost.op_time import node_flops, op_work
from autopar.errors import close_matches
from autopar.trace.module_paths import module_paths
from autopar.errors import PipelineError
from autopar.parallel.pipeline.schedules import V_SHAPED, v_rank
from autopar.sharding.rules import VIEW

aten = torch.ops.aten


@dataclass
class Stage:
    index: int
    nodes: list[str]  # compute nodes, in order
    attrs: list[str] = field(default_factory=list)  # placeholder names of params/buffers read
    inputs: list[str] = field(default_factory=list)  # user-input placeholders read
    recv: list[tuple[str, int]] = field(default_factory=list)  # (value, producing stage)
    send: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (value, consumer stages)
    has_output: bool = False
    flops: float = 0.0
    param_bytes: int = 0
    out_bytes: float = 0.0  # bytes of its ops' outputs (views left out): its share of the activations

    @property
    def cost(self) -> float:
        return 3.0 * self.flops + self.param_bytes


@dataclass
class StageLayout:
    """The stages of a pipelined plan and the values that cross between them."""

    options: object  # the ap.Pipeline it was cut for
    axis: int  # mesh axis index of the pipeline
    pp: int  # its size
    stages: list[Stage]
    value_ids: dict[str, int]  # boundary value -> id (used in message tags)
    kinds: dict[str, str]  # boundary value -> "grad" (float tensor), "tensor" or "int"
    auto: bool  # cuts chosen by the cost model
    cut_paths: tuple = ()  # the module path each stage after the first starts at (as split_before)
    # stage -> its emitted program (the same on every rank; stage_module.py builds it once)
    programs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline coordinate (position on the pp axis) that runs ``stage``: stage % pp, or
        under ZBV and DualPipeV their V (rank r holds stages r and 2pp - 1 - r)."""
        if getattr(self.options, "schedule", None) in V_SHAPED:
            return v_rank(stage, self.pp)
        return stage % self.pp


# ------------------------------------------------------------------------------- costs
def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _out_bytes(node: fx.Node) -> float:
    """Bytes of the tensors ``node`` makes at the traced sizes (0 for views: they share storage)."""
    if node.op != "call_function" or op_work(node) is VIEW:
        return 0.0
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    total = 0.0
    for v in vals:
        if isinstance(v, torch.Tensor):
            total += (
                _numel([int(d.node.hint) if isinstance(d, torch.SymInt) else d for d in v.shape]) * v.element_size()
            )
    return total


def _param_bytes(node: fx.Node, attr_names: set[str]) -> int:
    total = 0
    for a in node.all_input_nodes:
        if a.op == "placeholder" and a.name in attr_names and isinstance(a.meta.get("val"), torch.Tensor):
            v = a.meta["val"]
            total += _numel(v.shape) * v.element_size()
    return total


_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # GraphModule -> (its nodes, their costs)


def _node_costs(gm, order: list, mesh, attr_names: set) -> tuple[list, list, list, list]:
    """(forward FLOPs, parameter bytes read, output bytes) of each node of ``order``, at the traced
    sizes (no layout: the same for every mesh), and the positions where a stage may start
    (_candidates). Kept per graph while its nodes stay the same (the search cuts one graph into
    stages for each stage count)."""
    cached = _COSTS.get(gm)
    if cached is not None and cached[0] == order:
        return cached[1]
    sizes = Numbers(mesh)  # FLOPs by the work each op's rule file declares (cost/plan_cost.py)
    costs = (
        [float(node_flops(n, sizes)) for n in order],
        [_param_bytes(n, attr_names) for n in order],
        [_out_bytes(n) for n in order],
        _candidates(order),
    )
    _COSTS[gm] = (order, costs)
    return costs


# ------------------------------------------------------------------------------- cuts
def _unit(node: fx.Node) -> str:
    """The block a node belongs to: its module path up to the first list index (``blocks.3``)."""
    paths = module_paths(node)
    if not paths:
        return ""
    parts = paths[-1].split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _candidates(order: list[fx.Node]) -> list[int]:
    """Positions where a stage may start: where the owning block changes (never inside a
    multi-output op's getitems)."""
    units = [_unit(n) for n in order]
    return [
        i
        for i in range(1, len(order))
        if units[i] and units[i] != units[i - 1] and order[i].target is not operator.getitem
    ]


def annotated_cuts(order: list[fx.Node], paths: list[str]) -> list[int]:
    """Positions of the first node of each ``split_before`` module path."""
    cuts = []
    for path in paths:
        hits = [
            i
            for i, n in enumerate(order)
            if path in module_paths(n) or any(p.startswith(path + ".") for p in module_paths(n))
        ]
        if not hits:
            known = sorted({p for n in order for p in module_paths(n)})
            raise PipelineError(
                f"split_before({path!r}): no operation of the traced graph belongs to module "
                f"{path!r}. Known module paths include {close_matches(path, known)}."
            )
        if hits[0] == 0:
            raise PipelineError(
                f"split_before({path!r}) is the model's first operation: a stage boundary "
                "there would leave stage 0 empty; drop that annotation."
            )
        cuts.append(hits[0])
    return sorted(set(cuts))


def balanced_cuts(costs: list[float], candidates: list[int], n_stages: int, weights=None) -> list[int]:
    """Cut positions (from ``candidates``) that minimise the most expensive stage; ``weights``
    (one per stage) multiply each stage's cost (the micro-batches a 1F1B stage holds at once,
    to even out memory instead of time).

    Example:
        >>> balanced_cuts([4, 1, 1, 1, 1], [1, 2, 3, 4], 2)
        [1]
    """
    w = list(weights) if weights is not None else [1.0] * n_stages
    if n_stages == 1:
        return []
    if len(candidates) < n_stages - 1:
        candidates = list(range(1, len(costs)))
    if len(candidates) < n_stages - 1:
        raise PipelineError(
            f"The graph has only {len(costs)} operations; it cannot be cut into "
            f"{n_stages} stages. Use fewer stages (pp * chunks)."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends = candidates + [len(costs)]
    back = _stage_table(np.array([prefix[e] for e in ends]), w, n_stages)
    cuts, j = [], len(ends) - 1
    for k in range(n_stages - 1, 0, -1):
        j = int(back[k][j])
        cuts.append(ends[j])
    return sorted(cuts)


def _stage_table(at_end, w: list, n_stages: int):
    """back[k][j]: where the last of k + 1 stages ending at ``at_end[j]`` (the cost before that
    end) starts, for the least most expensive stage (-1: none). The dynamic program over
    (stages, end, start), a row of starts at once: a 405B's 32 stages over its 128 block
    boundaries were half a million Python steps per cut. The same choice as one start at a time
    with a strict ``<``: the same float operations, and argmin keeps the first of equal ones."""
    n = len(at_end)
    inf = float("inf")
    # best[j]: the least max-stage cost covering nodes [0, ends[j]) with k + 1 stages
    best = w[0] * at_end
    back = np.full((n_stages, n), -1)
    earlier = np.tri(n, n, -1, dtype=bool).T  # earlier[i, j]: start i comes before end j
    span = at_end[None, :] - at_end[:, None]  # span[i, j]: the cost from end i to end j
    for k in range(1, n_stages):
        v = np.where(earlier, np.maximum(best[:, None], w[k] * span), inf)
        i = np.argmin(v, axis=0)
        low = v[i, np.arange(n)]
        back[k] = np.where(low < inf, i, -1)
        best = low
    return back


# ------------------------------------------------------------------------------- layout
def split_stages(traced, mesh, options, split_paths: list[str], weights=None) -> StageLayout:
    """Assign every node to a stage and work out each stage's inputs, outputs and params
    (``weights``: per stage, for the automatic cut: balanced_cuts)."""
    axis = mesh.axis_index(options.axis)
    pp = mesh.shape[axis]
    n_stages = pp * options.chunks
    if traced.buffer_mutations:
        raise PipelineError(
            f"The model updates buffers in forward ({sorted(traced.buffer_mutations.values())}, "
            "e.g. BatchNorm running stats); pipelined plans do not support that yet: "
            "use a model without buffer updates (LayerNorm) or no pipeline."
        )
    graph = traced.gm.graph
    order = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    attr_names = set(traced.param_fqn) | set(traced.buffer_fqn) | set(traced.constant_fqn)
    flops, params, outs, candidates = _node_costs(traced.gm, order, mesh, attr_names)
    costs = [3.0 * f + b for f, b in zip(flops, params)]
    if split_paths:
        cuts = annotated_cuts(order, split_paths)
        if len(cuts) + 1 != n_stages:
            raise PipelineError(
                f"{len(split_paths)} split_before annotations ({', '.join(split_paths)}) make "
                f"{len(cuts) + 1} stages, but the pipeline needs {n_stages} "
                f"({options.axis}={pp} x chunks={options.chunks}). Annotate "
                f"{n_stages - 1} module paths, or none for an automatic split."
            )
    else:
        cuts = balanced_cuts(costs, candidates, n_stages, weights)
    bounds = [0] + cuts + [len(order)]
    stages = [Stage(s, [n.name for n in order[bounds[s] : bounds[s + 1]]]) for s in range(n_stages)]
    stage_of = {n.name: s for s in range(n_stages) for n in order[bounds[s] : bounds[s + 1]]}
    for s, st in enumerate(stages):
        if not st.nodes:
            raise PipelineError(f"Pipeline stage {s} has no operations; move the split_before annotations.")
        for i in range(bounds[s], bounds[s + 1]):
            st.flops += flops[i]
            st.param_bytes += params[i]
            st.out_bytes += outs[i]
    layout = StageLayout(options, axis, pp, stages, {}, {}, auto=not split_paths)
    layout.cut_paths = tuple(_unit(order[c]) for c in cuts)  # the cuts as split_before module paths
    _wire(graph, traced, layout, stage_of)
    return layout


def _wire(graph, traced, layout: StageLayout, stage_of: dict[str, int]) -> None:
    """Fill each stage's attrs, inputs, recv and send lists."""
    attrs = set(traced.param_fqn) | set(traced.buffer_fqn) | set(traced.constant_fqn)
    users: dict[str, set[int]] = {}
    last = layout.n_stages - 1
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        s = last if node.op == "output" else stage_of[node.name]
        st = layout.stages[s]
        for a in node.all_input_nodes:
            if a.op == "placeholder":
                lst = st.attrs if a.name in attrs else st.inputs
                if a.name not in lst:
                    lst.append(a.name)
            elif stage_of[a.name] != s:
                users.setdefault(a.name, set()).add(s)
    layout.stages[last].has_output = True
    for name in (n.name for n in graph.nodes if n.name in users):
        src = stage_of[name]
        layout.value_ids[name] = len(layout.value_ids)
        layout.kinds[name] = _kind(graph, name)
        layout.stages[src].send.append((name, tuple(sorted(users[name]))))
        for dst in sorted(users[name]):
            layout.stages[dst].recv.append((name, src))


def _kind(graph, name: str) -> str:
    node = next(n for n in graph.nodes if n.name == name)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "grad" if val.dtype.is_floating_point or val.dtype.is_complex else "tensor"
    if isinstance(val, (int, torch.SymInt)):
        return "int"
    raise PipelineError(
        f"Value {name!r} ({type(val).__name__}) crosses a pipeline stage boundary; only "
        "tensors and integer sizes can be sent. Move the split_before annotation so "
        f"that {name!r} and its users are in the same stage."
    )


# ------------------------------------------------------------------------------- display
def describe(layout: StageLayout, graph) -> str:
    """Text for the plan: one line per stage (ops, modules, params, FLOPs, what it sends)."""
    o = layout.options
    how = "automatic (cost model: 3 x FLOPs + parameter bytes)" if layout.auto else "split_before annotations"
    lines = [
        f"pipeline on axis {o.axis!r} (size {layout.pp}): {layout.n_stages} stages, "
        f"{o.microbatches} micro-batches, schedule {o.kind}"
        f"{f' x {o.chunks} chunks' if o.chunks > 1 else ''}, checkpoint {'on' if o.checkpoint else 'off'}; "
        f"boundaries {how}"
    ]
    nodes = {n.name: n for n in graph.nodes}
    total = sum(s.cost for s in layout.stages) or 1.0
    for st in layout.stages:
        units = [u for u in dict.fromkeys(_unit(nodes[n]) for n in st.nodes) if u]
        mods = units[0] + (f" .. {units[-1]}" if len(units) > 1 else "") if units else "<top>"
        sends = ", ".join(f"{v}->s{'/s'.join(map(str, d))}" for v, d in st.send) or "-"
        lines.append(
            f"  stage {st.index} (pp rank {layout.rank_of_stage(st.index)}): {len(st.nodes)} ops, "
            f"modules {mods}, params {st.param_bytes / 1024:.1f} KiB, "
            f"{st.flops / 1e6:.2f} MFLOP fwd, cost share {st.cost / total:.0%}; sends {sends}"
        )
    return "\n".join(lines)
