"""What a parameter looks like on the mesh: which piece of it each rank holds.

``plan.param_on_mesh(name)`` draws the mesh as a grid (rows: every axis but the last, columns:
the last axis) and, in each rank's cell, the tensor as a rectangle (dim 0 down, dim 1 across;
a vector is one bar) with that rank's piece shaded: blue where it holds the values, orange
where it holds partial sums of the whole (``P``). The pieces are cut by the same code that
shards the state dict (``narrow_piece``), so uneven and blocked splits show as they are stored.
SVG in Jupyter (and in static HTML: no kernel, no script), a grid of index ranges as text.

Example:
    >>> plan.param_on_mesh("model.layers.0.self_attn.q_proj.weight")    # in a notebook cell
    >>> print(plan.param_on_mesh("blocks.0.mlp.fc.weight"))
    blocks.0.mlp.fc.weight (128, 32) float32, (R, S(0)) on Mesh(dp=2, tp=2): each rank's piece as [dim 0, dim 1]
          tp=0       tp=1
    dp=0  0:64, :    64:128, :
    dp=1  0:64, :    64:128, :
"""

from __future__ import annotations

import difflib
from html import escape

import torch

from autopar.errors import PlanError
from autopar.placement import Partial, Shard, fmt_spec, narrow_piece

CELL_W, CELL_H, PAD, LABEL = 64, 44, 14, 56  # one rank's picture and the space around it


def held_indices(size: int, dim: int, placements, mesh, coords) -> list[int]:
    """The indices of tensor dim ``dim`` (of ``size``) the rank at ``coords`` holds, in order."""
    idx = torch.arange(size)
    for axis, p in enumerate(placements):
        if not isinstance(p, Shard) or p.dim != dim:
            continue
        if p.of is not None:  # an item of a split list: whole on its owner, empty elsewhere
            idx = idx if p.position(coords[axis]) == p.owner(mesh.shape[axis]) else idx[:0]
        else:
            idx = narrow_piece(idx, 0, p.pieces(mesh.shape[axis]), p.position(coords[axis]), p.blocks)
    return idx.tolist()


def runs(indices: list[int]) -> list[tuple[int, int]]:
    """[(start, stop)] of the contiguous runs in ``indices`` (a blocked split holds several)."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [tuple(r) for r in out]


class ParamOnMesh:
    """One parameter's pieces on every rank (see the module docstring)."""

    def __init__(self, plan, name: str):
        specs = plan.param_specs
        if name not in specs:
            near = difflib.get_close_matches(name, list(specs), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(near)}?" if near else " plan.param_specs lists the names."
            raise PlanError(f"{name!r} is not a parameter of {type(plan.model).__name__}.{hint}")
        param = plan.model.get_parameter(name)
        self.name, self.mesh, self.placements = name, plan.mesh, tuple(specs[name])
        self.shape, self.dtype = tuple(param.shape), str(param.dtype).replace("torch.", "")
        self.dims = self.shape[:2] if self.shape else (1,)
        self.partial = any(isinstance(p, Partial) for p in self.placements)
        # per rank: per shown dim, the runs of indices held
        self.pieces = [
            [runs(held_indices(n, d, self.placements, self.mesh, self.mesh.coords(r))) for d, n in enumerate(self.dims)]
            for r in range(self.mesh.size)
        ]

    def title(self) -> str:
        return f"{self.name} {self.shape} {self.dtype}, {fmt_spec(self.placements)} on {self.mesh}"

    def grid(self) -> tuple[list[str], list[str], list[list[int]]]:
        """Row labels, column labels and the rank at each cell."""
        names, shape = self.mesh.axis_names, self.mesh.shape
        cols = [f"{names[-1]}={c}" for c in range(shape[-1])]
        rows, ranks = [], []
        for head in range(self.mesh.size // shape[-1]):
            first = head * shape[-1]
            coords = self.mesh.coords(first)[:-1]
            rows.append(", ".join(f"{a}={c}" for a, c in zip(names, coords)) or "")
            ranks.append([first + c for c in range(shape[-1])])
        return rows, cols, ranks

    def cell_text(self, rank: int) -> str:
        parts = []
        for d, rs in enumerate(self.pieces[rank]):
            whole = rs == [(0, self.dims[d])]
            parts.append(":" if whole else "+".join(f"{a}:{b}" for a, b in rs) or "none")
        return ", ".join(parts) + (" (P)" if self.partial else "")

    def __str__(self) -> str:
        rows, cols, ranks = self.grid()
        cells = [[self.cell_text(r) for r in line] for line in ranks]
        w0 = max(len(x) for x in rows)
        w = max(len(c) for c in cols + [c for line in cells for c in line]) + 2
        what = ", ".join(f"dim {d}" for d in range(len(self.dims)))
        lines = [self.title() + f": each rank's piece as [{what}]" + (", partial sums" if self.partial else "")]
        lines.append(" " * (w0 + 2) + "".join(c.ljust(w) for c in cols))
        lines += [(rows[i].ljust(w0 + 2) + "".join(c.ljust(w) for c in cells[i])).rstrip() for i in range(len(rows))]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_svg_(self) -> str:
        rows, cols, ranks = self.grid()
        width = max(LABEL + len(cols) * (CELL_W + PAD) + PAD, 7 * len(self.title()))
        height = 40 + len(rows) * (CELL_H + PAD)
        color = "#f59e0b" if self.partial else "#3b82f6"
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
            'font-size="10">',
            f'<text x="0" y="12" font-size="11">{escape(self.title())}</text>',
        ]
        for j, c in enumerate(cols):
            out.append(f'<text x="{LABEL + j * (CELL_W + PAD)}" y="32">{escape(c)}</text>')
        for i, line in enumerate(ranks):
            y = 40 + i * (CELL_H + PAD)
            out.append(f'<text x="0" y="{y + CELL_H / 2 + 3}">{escape(rows[i])}</text>')
            for j, rank in enumerate(line):
                out += self._cell_svg(rank, LABEL + j * (CELL_W + PAD), y, color)
        return "\n".join(out + ["</svg>"])

    def _cell_svg(self, rank: int, x: float, y: float, color: str) -> list[str]:
        """The tensor's outline with the rank's piece (every run of dim 0 x every run of dim 1) filled."""
        tip = escape(f"rank {rank} {self.mesh.coords(rank)}: [{self.cell_text(rank)}]")
        out = [
            f'<g><title>{tip}</title><rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" fill="#f1f5f9" '
            'stroke="#64748b"/>'
        ]
        down = self.pieces[rank][0] if len(self.dims) == 2 else [(0, 1)]
        across = self.pieces[rank][-1]
        rows_n, cols_n = (self.dims[0] if len(self.dims) == 2 else 1), self.dims[-1]
        for a, b in down:
            for c, d in across:
                out.append(
                    f'<rect x="{x + CELL_W * c / cols_n:.1f}" y="{y + CELL_H * a / rows_n:.1f}" '
                    f'width="{CELL_W * (d - c) / cols_n:.1f}" height="{CELL_H * (b - a) / rows_n:.1f}" fill="{color}"/>'
                )
        out.append(f'<text x="{x}" y="{y + CELL_H + 10}" font-size="9" fill="#475569">rank {rank}</text></g>')
        return out

    def _repr_html_(self) -> str:
        return self._repr_svg_()
