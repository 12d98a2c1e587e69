"""Sizes as sympy formulas: tensor shapes in named dims (B, S, ...) and mesh axis sizes (dp, tp).

The traced graph's shapes carry torch SymInts for the dynamic dims (``s0``, ``s1``...). They
are renamed after the user input dims they came from: dim 0 of an input is the batch ``B``,
dim 1 of an input with 2+ dims the sequence ``S``, others ``<input>_<dim>``. Each mesh axis
is a symbol named like the axis. Inputs whose dim 0 (or 1) have the same example size share
the name (the targets' batch is the batch). Static model sizes may be given names too
(``sizes={"H": 32}`` turns a dim of 96 into ``3*H``). Every formula evaluates at the
example: the example inputs' sizes and the mesh's axis sizes.

Example:
    >>> sy = PlanSymbols.of(plan, sizes={"H": 32})
    >>> sy.local_bytes(node, (Shard(0), Shard(2)))       # 4*B*S*H/(dp*tp) for a float32 (B, S, H)
    >>> sy.value(4*sy["B"]*sy["S"])                        # 256.0 at B=8, S=8
"""

from __future__ import annotations

import math
import re

import sympy
import torch

from autopar.mesh import SubAxis
from autopar.placement import Shard, is_uneven


def _sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, positive=True, integer=True)


class PlanSymbols:
    """The symbols of one plan and their example values."""

    def __init__(self, mesh, dims: dict, example: dict, sizes: dict):
        self.mesh = mesh
        self.dims = dims  # torch's own symbol (s0) -> named symbol (B)
        self.example = example  # named symbol -> example value
        self.sizes = sizes  # named static size symbol -> value (H -> 32)
        self.axes = [_sym(a) for a in mesh.axis_names]
        for a, n in zip(self.axes, mesh.shape):
            self.example[a] = n

    @classmethod
    def of(cls, plan, sizes: dict | None = None, names: dict | None = None) -> "PlanSymbols":
        """Symbols for ``plan``; ``names`` renames dims ({"S": "T"} or one input's {"idx.1": "T"}),
        ``sizes`` names static sizes ({"H": 768})."""
        dims, example = {}, {}
        for node in plan.graph.nodes:
            if node.op != "placeholder" or node.name not in plan.traced.user_inputs:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            for d, s in enumerate(val.shape):
                if not isinstance(s, torch.SymInt) or not isinstance(s.node.expr, sympy.Symbol):
                    continue
                if s.node.expr in dims:
                    continue
                hint = int(s.node.hint)
                default = _default_name(node.name, d, val.dim())
                name = (names or {}).get(f"{node.name}.{d}") or (names or {}).get(default) or default
                if example.get(_sym(name), hint) != hint:  # same role, other size: its own symbol
                    name = f"{_ident(node.name)}_{d}"
                dims[s.node.expr] = _sym(name)
                example[dims[s.node.expr]] = hint
        named = {_sym(k): int(v) for k, v in (sizes or {}).items()}
        example.update(named)
        return cls(plan.mesh, dims, example, named)

    def __getitem__(self, name: str) -> sympy.Symbol:
        for s in list(self.example):
            if s.name == name:
                return s
        raise KeyError(f"no symbol {name!r}; the plan's symbols are {[s.name for s in self.example]}")

    # ----------------------------------------------------------------- sizes
    def dim(self, size) -> sympy.Expr:
        """One global dim as a formula (SymInt -> named dims, int -> a named size where it fits)."""
        if isinstance(size, torch.SymInt):
            expr = sympy.sympify(size.node.expr).xreplace(self.dims)
            if expr.free_symbols - set(self.example) and size.node.hint is not None:
                return sympy.Integer(int(size.node.hint))  # a size not from the inputs: its example value
            return expr
        return self._static(int(size))

    def _static(self, n: int) -> sympy.Expr:
        for sym, v in self.sizes.items():
            if n == v:
                return sym
        for sym, v in sorted(self.sizes.items(), key=lambda kv: -kv[1]):
            if v > 1 and n % v == 0 and n // v <= 8:
                return (n // v) * sym
        return sympy.Integer(n)

    def shape(self, shape, placements=None) -> list[sympy.Expr]:
        """The local shape (global / product of the axes that split each dim); a static dim that
        does not divide by its axis counts its largest piece (ceiling: the first ranks' rows,
        the ones that set a step's time and a rank's peak memory)."""
        out = [self.dim(s) for s in shape]
        for axis, p in enumerate(placements or ()):
            if isinstance(p, Shard):
                out[p.dim] = out[p.dim] / self._pieces(p, axis)
                if is_uneven(shape[p.dim], p.pieces(self.mesh.shape[axis])):
                    out[p.dim] = sympy.ceiling(out[p.dim])
        return out

    def _pieces(self, p: Shard, axis: int) -> sympy.Expr:
        """Into how many pieces ``p`` cuts its dim on mesh axis ``axis`` (on a part of it: a number)."""
        if p.within:
            return sympy.Integer(p.within)
        return self.axes[axis] / p.across if p.across else self.axes[axis]

    def numel(self, shape, placements=None) -> sympy.Expr:
        return sympy.Mul(*self.shape(shape, placements))

    def local_bytes(self, node, placements=None) -> sympy.Expr:
        """Bytes of ``node``'s (first) tensor output on one rank, laid out as ``placements``."""
        val = node.meta["val"]
        if isinstance(val, (list, tuple)):
            val = next(v for v in val if isinstance(v, torch.Tensor))
        return self.numel(val.shape, placements) * val.dtype.itemsize

    def axis(self, name_or_index) -> sympy.Expr:
        """The size of a mesh axis (a name or an index) as a symbol; of a part of a merged axis
        (its inner axis' name: a group's ranks), the number of ranks in it; of a group over
        several axes (``Mesh.axis_label``'s ``"dp*cp"``, or their tuple), the product."""
        if isinstance(name_or_index, str) and "*" in name_or_index:
            name_or_index = tuple(name_or_index.split("*"))
        if isinstance(name_or_index, tuple):
            return sympy.Mul(*(self.axis(a) for a in name_or_index))
        if isinstance(name_or_index, SubAxis):
            i, sub = name_or_index.axis, name_or_index
        else:
            i, sub = self.mesh.sub_axis(name_or_index)
        if sub is None:
            return self.axes[i]
        return sympy.Integer(sub.within) if sub.part == "inner" else self.axes[i] / sub.within

    # ------------------------------------------------------------- evaluate
    def value(self, expr, **values) -> float:
        """``expr`` as a number at the example (``values`` override by symbol name: B=32)."""
        sub = dict(self.example)
        for k, v in values.items():
            sub[self[k]] = v
        return float(sympy.sympify(expr).xreplace(sub))


def _default_name(input_name: str, d: int, ndim: int) -> str:
    """Batch and sequence dims of every input share one name (B, S) when their sizes agree."""
    if d == 0:
        return "B"
    if d == 1 and ndim >= 2:
        return "S"
    return f"{_ident(input_name)}_{d}"


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def simplify(expr) -> sympy.Expr:
    """A readable form: factored over the common terms (4*B*S*H*(tp - 1)/tp)."""
    e = sympy.factor(sympy.together(sympy.sympify(expr)))
    return e


class Numbers(PlanSymbols):
    """PlanSymbols that give numbers at the example: sizes are ints, axes are the mesh's sizes."""

    def __init__(self, mesh):
        super().__init__(mesh, {}, {}, {})
        self.axes = list(mesh.shape)

    def dim(self, size):
        return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)

    def numel(self, shape, placements=None):
        return float(math.prod(self.shape(shape, placements)))

    def value(self, expr, **values) -> float:
        return float(expr)
