"""plan.draw(rank): one rank's emitted graph as Graphviz, collectives coloured.

Nodes are the rank's ops (parameters left out unless ``params=True``), grouped in clusters
by layer (``blocks.0``...); collectives are filled by kind (all-reduce red, all-gather blue,
reduce-scatter yellow, all-to-all violet; "f" and local slices pale). With Graphviz's
``dot`` on PATH the drawing renders to SVG (shown inline in Jupyter); without it you get
the DOT text (paste it into any Graphviz viewer).

Example:
    >>> d = plan.draw(0)
    >>> d.save("rank0.svg")     # or rank0.dot when dot is missing
    >>> print(d.dot[:200])
"""

from __future__ import annotations

import operator
import shutil
import subprocess
from collections import defaultdict

from autopar.cost.plan_cost import layer_of
from autopar.trace.module_paths import module_path

COLLECTIVE_COLORS = {
    "all_reduce": "#f4a3a3",
    "all_gather": "#a3c8f4",
    "reduce_scatter": "#f4d28a",
    "all_to_all": "#c6a3f4",
    "ring_shift": "#a3f4c6",
    "grad_all_reduce": "#fbd9d9",
    "shard": "#e0ecfa",
    "to_partial": "#eeeeee",
    "scale_grad": "#eeeeee",
}


SIZE_OPS = {operator.mul, operator.floordiv, operator.add, operator.sub, operator.truediv}


class Drawing:
    """DOT text, and SVG when Graphviz is available."""

    def __init__(self, dot: str, svg: str | None):
        self.dot, self.svg = dot, svg

    def __str__(self) -> str:
        return self.dot

    def _repr_svg_(self):
        return self.svg

    def _repr_pretty_(self, p, cycle):
        p.text(self.dot if self.svg is None else f"<SVG drawing, {len(self.svg)} chars>")

    def save(self, path) -> str:
        """Write SVG (when rendered) or DOT; returns the path written."""
        text = self.svg if self.svg is not None and str(path).endswith(".svg") else self.dot
        with open(path, "w") as f:
            f.write(text)
        return str(path)


def _name(node) -> str:
    t = node.target
    return getattr(t, "__name__", str(t)).split(".")[0]


def _label(node) -> tuple[str, str | None]:
    """(label, fill colour or None) for one node of the emitted graph."""
    ns = getattr(node.target, "namespace", None)
    op = _name(node)
    if ns == "autopar":
        axis = next((a for a in node.args[1:] if isinstance(a, str)), "")  # the axis is the first str arg
        return f"{op}\\n{axis}", COLLECTIVE_COLORS.get(op, "#dddddd")
    if node.op == "placeholder":
        return f"input {node.name}", "#e8f5e9"
    if node.op == "get_attr":
        return str(node.target), "#f5f5f5"
    if node.op == "output":
        return "output", "#e8f5e9"
    return op, None


def _layer(node) -> str:
    """A node's layer; a collective (made without module info) joins its consumer's."""
    if node.op != "call_function":
        return ""
    seen = 0
    while not module_path(node) and node.users and seen < 8:
        node, seen = next(iter(node.users)), seen + 1
    return layer_of(module_path(node))


def _is_size(node) -> bool:
    """Symbolic size arithmetic (sym_size, int mul/floordiv): clutter in a drawing of tensors."""
    return node.op == "call_function" and (_name(node) == "sym_size" or node.target in SIZE_OPS)


def to_dot(graph, title: str, params: bool = False) -> str:
    clusters = defaultdict(list)
    edges = []
    for node in graph.nodes:
        if (node.op == "get_attr" and not params) or _is_size(node):
            continue
        label, fill = _label(node)
        style = f', style=filled, fillcolor="{fill}"' if fill else ""
        clusters[_layer(node)].append(f'  "{node.name}" [label="{label}"{style}];')
        for inp in node.all_input_nodes:
            if (inp.op != "get_attr" or params) and not _is_size(inp):
                edges.append(f'  "{inp.name}" -> "{node.name}";')
    lines = [
        f'digraph "{title}" {{',
        '  rankdir=TB; node [shape=box, fontsize=10, fontname="monospace"];',
        f'  label="{title}"; labelloc=t;',
    ]
    for i, (layer, items) in enumerate(clusters.items()):
        if layer and layer != "(top)":
            lines += [f"  subgraph cluster_{i} {{", f'  label="{layer}"; color="#bbbbbb";', *items, "  }"]
        else:
            lines += items
    return "\n".join(lines + edges + ["}"])


def render_svg(dot: str, timeout: float = 30.0) -> str | None:
    exe = shutil.which("dot")
    if exe is None:
        return None
    done = subprocess.run([exe, "-Tsvg"], input=dot, capture_output=True, text=True, timeout=timeout)
    return done.stdout if done.returncode == 0 else None


def draw(plan, rank: int = 0, params: bool = False, svg: bool = True) -> Drawing:
    graph = plan.module(rank).graph
    dot = to_dot(graph, f"{type(plan.model).__name__} rank {rank} on {plan.mesh}", params)
    return Drawing(dot, render_svg(dot) if svg else None)
