"""Build the emitted program's torch.fx graph: local pieces, collectives on the edges, local shapes.

The emitter walks the planned graph in order and writes a new graph for ``rank``:
parameters become attributes (``get_attr`` with the serial names); each input edge whose
layout differs from what the op's strategy needs gets the redistribution's collectives
(shared between consumers that need the same layout); replicated inputs of split compute
get Megatron's "f" where their gradient must be made whole; shape arguments of views are
rewritten to local sizes. Symbolic sizes stay *global* in the graph (``sym_size`` of a split
dim is multiplied back), and only shape arguments are divided, so size arithmetic in the
model needs no rewriting.

Example:
    >>> graph = emit_graph(plan)      # one program for every rank
    >>> print(plan.module(0).code)   # ... autopar.all_reduce.default(linear, 'tp', autopar_group_1, autopar_rank, 'sum')

The program is the same on every rank: what differs (the rank, its groups, its position on
each axis) is read from attributes of the rank's module (``rank_attrs``). The Python code is
therefore generated once per plan, not once per rank, which is most of emission's cost.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.runtime.collectives import plain_eager
from autopar.codegen.input_guard import check_local_inputs, guard_args
from autopar.sharding.lowerings.random_draws import random_lowering
from autopar.sharding.lowerings.base import lowering_for
from autopar.placement import (
    PIECE_ORDERS,
    Partial,
    Shard,
    is_uneven,
    piece_size,
    piece_start,
    shard_factor,
    uneven_dims,
)
from autopar.errors import ShardingError
from autopar.mesh import SubAxis
from autopar.sharding.piece_order import piece_orders
from autopar.runtime.uneven import (
    from_padded,
    pad_piece,
    piece_share,
    ragged_all_gather,
    ragged_share,
    ragged_total,
    to_padded,
    trim_piece,
    weigh,
)
from autopar.sharding.propagate import layout_of
from autopar.sharding.redistribute import STEP_KINDS, plan_steps
from autopar.sharding.rules import TensorMeta, op_traits

aten = torch.ops.aten
ops = torch.ops.autopar


RANK_ATTR = "autopar_rank"
SOURCE = "autopar_source"  # node.meta key of an emitted node: the traced node it came from


def keep_meta(node: fx.Node, new) -> None:
    """An emitted node keeps the traced node's module path and source line (display, errors)
    and its name (a program rewrite finds the traced node it came from: parallel/data_parallel/precision.py)."""
    if isinstance(new, fx.Node):
        if not new.meta:
            new.meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
        new.meta.setdefault(SOURCE, node.name)


def rank_attrs(mesh, rank: int) -> dict:
    """The per-rank constants an emitted program reads from its module: the rank, and per mesh
    axis i its group (``autopar_group_i``) and its position on the axis (``autopar_coord_i``), and
    the same on both parts of the axis cut into groups of k consecutive positions (an axis made of
    two merged ones, a tensor split on one part, Shard.within / across): within this rank's group
    (``autopar_group_i_ink``) and across the groups (``autopar_group_i_outk``: the ranks at its
    position in every group)."""
    out = {RANK_ATTR: rank}
    coords = mesh.coords(rank)
    for i in range(mesh.ndim):
        out[f"autopar_group_{i}"] = list(mesh.group(i, rank))
        out[f"autopar_coord_{i}"] = coords[i]
        for k in range(2, mesh.shape[i]):  # groups of k consecutive positions (SubAxis)
            if mesh.shape[i] % k == 0:
                for part in (SubAxis(i, k, "inner"), SubAxis(i, k, "outer")):
                    out[f"autopar_group_{i}{part_suffix(part)}"] = list(mesh.group(part, rank))
                    out[f"autopar_coord_{i}{part_suffix(part)}"] = part.position(coords[i])
    return out


def part_suffix(part: SubAxis | None) -> str:
    """The suffix of a part's rank constants (``rank_attrs``): "" for the whole axis."""
    if part is None:
        return ""
    return f"_in{part.within}" if part.part == "inner" else f"_out{part.within}"


class Emitter:
    def __init__(self, plan):
        self.plan, self.mesh = plan, plan.mesh
        self.graph = fx.Graph()
        self._rank_nodes: dict[str, fx.Node] = {}
        self.env: dict[fx.Node, fx.Node] = {}
        self.edges: dict[tuple, fx.Node] = {}
        self.scaled: dict[fx.Node, tuple[fx.Node, int]] = {}  # global size node -> (local, factor)
        # which split values are in the zig-zag order (load-balanced context parallel) and which plain
        self.orders = piece_orders(plan)

    # ------------------------------------------------------------------ helpers
    def global_shape(self, node: fx.Node) -> tuple:
        """``node``'s global shape for a lowering: ints where static; a dynamic dim (a batch, or
        any dim of a weight passed as an input) as a value of the program, its local size times
        its pieces (the traced symbol, ``s77``, is defined nowhere in the emitted code)."""
        return tuple(
            self.global_size(node, d) if isinstance(s, torch.SymInt) and not s.node.expr.is_number else int(s)
            for d, s in enumerate(node.meta["val"].shape)
        )

    def global_size(self, x: fx.Node, dim: int) -> fx.Node:
        """The global size of ``x``'s dim ``dim`` at run time, from its local value."""
        local = self.graph.call_function(aten.sym_size.int, (self.env[x], dim))
        spec, d = layout_of(x).spec, dim % x.meta["val"].dim()
        f = shard_factor(spec, self.mesh, d)
        if f == 1:
            return local
        axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == d]
        if len(axes) == 1 and axes[0] in self.plan.ragged:
            # pieces of any size: the global size is their sum (one all-reduce of one number);
            # local * f would be wrong wherever the whole dim is used (a gathered tensor's view)
            a = axes[0]
            group, rank = self.rank_value(f"autopar_group_{a}"), self.rank_value(RANK_ATTR)
            glob = self.graph.call_function(ragged_total, (self.env[x], d, self.mesh.axis_names[a], group, rank))
        else:
            glob = self.graph.call_function(operator.mul, (local, f))
        self.scaled[glob] = (local, f)
        return glob

    def local_size(self, size, f: int):
        """A (global) size divided into ``f`` equal pieces: an int, or a value of the program."""
        return self._local_size(size, f)

    def piece_bounds(self, size, axis: int, zigzag: bool = False) -> tuple:
        """(start, rows) of this rank's piece of a dim of global ``size`` split on mesh ``axis``,
        as values of the program (uneven pieces included: placement.piece_start / piece_size).
        ``zigzag``: the piece is in the zig-zag order (sharding/piece_order.py), two ranges: a
        lowering that reads one range declares ``Lowering.contiguous`` and gets the plain order."""
        if zigzag:
            raise ShardingError(
                f"internal: an op reads its piece on mesh axis {self.mesh.axis_names[axis]!r} as one range, but "
                "the piece is in the zig-zag order; its lowering must declare contiguous = True."
            )
        n, coord = self.mesh.shape[axis], self.coord(axis)
        call = self.graph.call_function
        return call(piece_start, (size, n, coord)), call(piece_size, (size, n, coord))

    def piece_of(self, size, spec, dim: int):
        """This rank's size of dim ``dim`` of a (global) ``size`` laid out ``spec``: an int where
        every rank's piece is the same, else a value of the program (``piece_size`` of its
        coordinate: the same code on every rank, uneven pieces included)."""
        axis = next((a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == dim), None)
        if axis is None or (isinstance(size, int) and size == -1):
            return size
        n = self.mesh.shape[axis]
        if is_uneven(size, n):
            return self.graph.call_function(piece_size, (size, n, self.coord(axis)))
        return self._local_size(size, n)

    def rank_value(self, name: str) -> fx.Node:
        """The module attribute ``name`` of ``rank_attrs`` (read once per program)."""
        if name not in self._rank_nodes:
            self._rank_nodes[name] = self.graph.get_attr(name)
        return self._rank_nodes[name]

    def eager_flag(self) -> fx.Node:
        """``plain_eager()`` asked once per forward: the ops may alias or work in place only
        when it is True (never in compiled or traced code, see collectives.plain_eager)."""
        if "autopar_eager" not in self._rank_nodes:
            self._rank_nodes["autopar_eager"] = self.graph.call_function(plain_eager, ())
        return self._rank_nodes["autopar_eager"]

    def coord(self, axis: int, part: SubAxis | None = None) -> fx.Node:
        """This rank's position on mesh axis ``axis`` (``part``: on that part of it, a SubAxis of
        the axis), as a value of the program."""
        return self.rank_value(f"autopar_coord_{axis}{part_suffix(part)}")

    def collective(self, op, args: tuple, axis: int, extra: tuple = (), part: SubAxis | None = None) -> fx.Node:
        """op(*args, [dims...], axis_name, group, rank, *extra) for mesh axis ``axis`` (``part``: among
        the ranks of this rank's group on that part of the axis, a SubAxis)."""
        group = self.rank_value(f"autopar_group_{axis}{part_suffix(part)}")
        name = self.mesh.axis_names[axis] if part is None else self.mesh.axis_label(part)
        return self.graph.call_function(op, (*args, name, group, self.rank_value(RANK_ATTR), *extra))

    def _step(self, x: fx.Node, st, gather=None, owned: bool = False, shape=(), sizes=()):
        """One redistribution step (``st.order`` / ``st.order2``: it joins or cuts pieces in
        another order than contiguous, Shard.order)."""
        gather = gather or ops.all_gather.default
        if st.order or st.order2:
            return self._ordered_step(x, st, gather, shape, sizes)
        if st.blocks > 1:
            return self._blocked_step(x, st, gather, sizes)
        n = self.mesh.shape[st.axis]
        dims = [d for d in (st.dim, st.dim2) if d is not None and d < len(shape)]
        if st.axis in self.plan.ragged and any(shape[d] is None for d in dims):
            if st.kind == "all_gather" and st.blocks == 1:  # sizes exchanged at run time
                group, rank = self.rank_value(f"autopar_group_{st.axis}"), self.rank_value(RANK_ATTR)
                args = (gather, x, st.dim, self.mesh.axis_names[st.axis], group, rank)
                return self.graph.call_function(ragged_all_gather, args)
            raise ShardingError(
                f"{st.kind} of dim {st.dim} on mesh axis {self.mesh.axis_names[st.axis]!r}: that dim is sized at run "
                "time and this plan lets it be cut unevenly (its example batch does not divide by the axis), so "
                "no rank knows the other pieces' sizes. Plan with an example batch that divides by "
                f"{n}, or keep that tensor split on {self.mesh.axis_names[st.axis]!r}."
            )
        if any(is_uneven(shape[d], n) for d in dims):
            return self._uneven_step(x, st, gather, shape)
        kind = STEP_KINDS[st.kind]
        if kind.op is not None:
            op = gather if st.kind == "all_gather" else getattr(ops, kind.op).default
            dims, extra = kind.op_args(st)
            owned = owned and st.kind == "all_reduce"
            flag = self.eager_flag() if owned else None  # in place only in plain eager mode
            node = self.collective(op, (x, *dims), st.axis, extra)
            if owned:
                node.kwargs = {"owned": flag}
            return node
        n = self.mesh.shape[st.axis]  # partial_cast: sum <-> avg is a local rescale
        factor = float(n) if st.op == "sum->avg" else 1.0 / n
        return self.graph.call_function(aten.mul.Tensor, (x, factor))

    def _uneven_step(self, x: fx.Node, st, gather, shape) -> fx.Node:
        """A step on a dim whose pieces differ in size: the even collective between a pad and a
        trim (runtime/uneven.py), so that gloo and NCCL move equal pieces."""
        g, n, coord = self.graph, self.mesh.shape[st.axis], self.coord(st.axis)

        def uneven(d):
            return d is not None and is_uneven(shape[d], n)

        def largest(d):
            return -(-int(shape[d]) // n)

        if st.kind == "all_gather":
            x = g.call_function(pad_piece, (x, st.dim, largest(st.dim)))
            x = self.collective(gather, (x, st.dim), st.axis)
            return g.call_function(from_padded, (x, st.dim, int(shape[st.dim]), n))
        if st.kind in ("slice", "reduce_scatter"):
            op = ops.shard.default if st.kind == "slice" else ops.reduce_scatter.default
            x = g.call_function(to_padded, (x, st.dim, int(shape[st.dim]), n))
            x = self.collective(op, (x, st.dim), st.axis, STEP_KINDS[st.kind].op_args(st)[1])
            return g.call_function(trim_piece, (x, st.dim, int(shape[st.dim]), n, coord))
        # all_to_all: the split dim leaves in its padded layout, the new one arrives padded
        src, dst = st.dim, st.dim2
        if uneven(dst):
            x = g.call_function(to_padded, (x, dst, int(shape[dst]), n))
        if uneven(src):
            x = g.call_function(pad_piece, (x, src, largest(src)))
        x = self.collective(ops.all_to_all.default, (x, src, dst), st.axis)
        if uneven(src):
            x = g.call_function(from_padded, (x, src, int(shape[src]), n))
        if uneven(dst):
            x = g.call_function(trim_piece, (x, dst, int(shape[dst]), n, coord))
        return x

    def _ordered_step(self, x: fx.Node, st, gather, shape, sizes) -> fx.Node:
        """A step joining or cutting pieces in another order than contiguous (Shard.order): the
        serial order is permuted to the ranks' pieces before a cut (slice, reduce-scatter, the
        split side of an all-to-all) and back after a concatenation (all-gather, the joined side),
        by the order's pair in placement.PIECE_ORDERS, so the collectives stay plain."""
        g, n = self.graph, self.mesh.shape[st.axis]
        if st.kind == "all_to_all":
            if st.order2:
                x = g.call_function(PIECE_ORDERS[st.order2][0], (x, st.dim2, n))
            x = self._step_plain(x, st, gather, shape, sizes)
            return g.call_function(PIECE_ORDERS[st.order][1], (x, st.dim, n)) if st.order else x
        if st.kind == "all_gather":
            x = self._step_plain(x, st, gather, shape, sizes)
            return g.call_function(PIECE_ORDERS[st.order][1], (x, st.dim, n, self._block_count(st, sizes)))
        # slice, reduce_scatter
        x = g.call_function(PIECE_ORDERS[st.order][0], (x, st.dim, n, self._block_count(st, sizes)))
        return self._step_plain(x, st, gather, shape, sizes)

    def _step_plain(self, x, st, gather, shape, sizes=()):
        """``st`` as on a contiguous axis (blocked: the blocks regrouped around the collective)."""
        if st.blocks > 1:
            return self._blocked_step(x, st, gather, sizes)
        dims, extra = STEP_KINDS[st.kind].op_args(st)
        op = gather if st.kind == "all_gather" else getattr(ops, STEP_KINDS[st.kind].op).default
        if any(
            is_uneven(shape[d], self.mesh.shape[st.axis]) for d in (st.dim, st.dim2) if d is not None and d < len(shape)
        ):
            raise ShardingError("load-balanced context parallel needs even pieces on its axis")
        return self.collective(op, (x, *dims), st.axis, extra)

    def _blocked_step(self, x: fx.Node, st, gather, sizes=()) -> fx.Node:
        """Gather or slice a blocked shard: plain collectives around a local regrouping.

        Gathered pieces arrive rank-major ([r0: b0 b1 b2][r1: b0 b1 b2]); the serial order is
        block-major, so (n, blocks, s) is transposed to (blocks, n, s). A slice views the dim
        as (blocks, s) and keeps this rank's chunk of every block.
        """
        g, d, n = self.graph, st.dim, self.mesh.shape[st.axis]
        k = self._block_count(st, sizes)
        if st.kind == "all_gather":
            full = self.collective(gather, (x, d), st.axis)
            grid = g.call_function(aten.unflatten.int, (full, d, [n, k, -1]))
            grid = g.call_function(aten.transpose.int, (grid, d, d + 1))
            return g.call_function(aten.flatten.using_ints, (grid, d, d + 2))
        grid = g.call_function(aten.unflatten.int, (x, d, [k, -1]))  # slice
        mine = self.collective(ops.shard.default, (grid, d + 1), st.axis)
        return g.call_function(aten.flatten.using_ints, (mine, d, d + 1))

    def _block_count(self, st, sizes):
        """The blocks of a blocked shard's dim as the program runs: ``st.blocks`` (the plan's
        count) where that dim is static; where it is sized at run time as blocks counted by an
        input's dim (a batch of sequences flattened: B x L, the blocks B), that input dim's size at
        run time, so that a pipeline's micro-batch (B/m sequences) regroups right."""
        k = st.blocks
        size = sizes[st.dim] if st.dim < len(sizes) else None
        if k == 1 or not isinstance(size, torch.SymInt) or size.node.shape_env is None:
            return k
        env = size.node.shape_env
        hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
        for sym in size.node.expr.free_symbols:
            if hints.get(sym) is not None and int(hints[sym]) == k and sym not in (size.node.expr / sym).free_symbols:
                value = self._input_dim(sym)
                if value is not None:
                    return value
        return k

    def _input_dim(self, sym):
        """The run-time size of the user-input dim traced as symbol ``sym`` (a batch first), or None."""
        found = []
        for node in self.plan.graph.nodes:
            val = node.meta.get("val")
            if node.op != "placeholder" or node not in self.env or not isinstance(val, torch.Tensor):
                continue
            found += [(d, node) for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr == sym]
        if not found:
            return None
        d, node = min(found, key=lambda f: f[0])
        return self.global_size(node, d)

    def edge(self, src: fx.Node, target: tuple, f_axes=frozenset(), reader: tuple = ()) -> fx.Node:
        """``src``'s value in layout ``target`` (collectives added once per layout). ``reader``:
        (node, input index) reading it, whose order of pieces it gets (Shard.order: the layouts
        with their orders, sharding/piece_order.py; a change of order is a step as any other)."""
        spec = self.orders.out_spec(src, layout_of(src).spec)
        target = self.orders.in_spec(*reader, target) if reader else self.orders.output_spec(spec, target)
        key = (src, target, frozenset(f_axes))
        if key not in self.edges:
            x = self.env[src]
            f_axes = set(f_axes)
            shape = _static_shape(src)
            val = src.meta.get("val")
            sizes = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
            for i, st in enumerate(_steps(spec, target)):
                if st.kind == "all_gather" and st.axis in f_axes and not _reordered(spec, target, st.axis):
                    # the gathered value's gradient arrives in parts: reduce-scatter it back
                    x = self._step(x, st, ops.all_gather_rs.default, shape=shape, sizes=sizes)
                    f_axes.discard(st.axis)
                    continue
                x = self._step(x, st, owned=i == 0 and self._owned(src), shape=shape, sizes=sizes)
            for axis in sorted(f_axes):
                flag = self.eager_flag()  # Megatron's f returns its input only in plain eager mode
                x = self.collective(ops.grad_all_reduce.default, (x,), axis)
                x.kwargs = {"alias": flag}
            self.edges[key] = x
        return self.edges[key]

    def _owned(self, src: fx.Node) -> bool:
        """Nothing but this edge reads ``src``'s local value, and autograd does not keep it: a
        collective may then work in place (see autopar::all_reduce's ``owned``)."""
        local = self.env[src]
        if local.op != "call_function" or local.target not in _FRESH_OUTPUT or len(src.users) != 1:
            return False
        user = next(iter(src.users))
        return user.op == "call_function" and "autopar" in user.meta and layout_of(user).inputs.count(src) == 1

    # -------------------------------------------------------------------- nodes
    def run(self) -> fx.Graph:
        guarded = False
        for node in self.plan.graph.nodes:
            if node.op != "placeholder" and not guarded:
                guarded = True
                self._input_guard()
            handler = getattr(self, f"_{node.op}")
            new = handler(node)
            if new is not None:
                keep_meta(node, new)
                self.env[node] = new
        self._own_gradients()
        self._drop_unused_totals()
        return self.graph

    def _drop_unused_totals(self) -> None:
        """A ragged dim's global size is an all-reduce (``ragged_total``), emitted with every
        ``sym_size`` of it; most are only divided back into the local size (``local_size``) and
        never read: those are removed, every rank alike, so no collective runs for nothing."""
        for node in reversed(list(self.graph.nodes)):
            if node.op == "call_function" and node.target is ragged_total and not node.users:
                self.graph.erase_node(node)

    def _own_gradients(self) -> None:
        """Megatron's f whose output only matmul-like ops read: its gradient is made afresh by
        their backward and held by nothing else, so in plain eager mode the backward all-reduce
        may work in place (``grad_owned``, given the same ``plain_eager()`` flag as ``alias``)."""
        for node in self.graph.nodes:
            if node.target is not ops.grad_all_reduce.default or "alias" not in node.kwargs:
                continue
            if node.users and all(_fresh_grad_use(u, node) for u in node.users):
                node.kwargs = {**node.kwargs, "grad_owned": node.kwargs["alias"]}

    def _placeholder(self, node):
        fqn = self.plan.attr_name(node.name)
        if fqn is not None:
            return self.graph.get_attr(fqn)
        return self.graph.placeholder(node.name)

    def _input_guard(self):
        """One check of the user inputs' local shapes before anything runs (see input_guard.py)."""
        args = guard_args(self.plan, self.env, self.rank_value(RANK_ATTR))
        if args is not None:
            self.graph.call_function(check_local_inputs, args)

    def _get_attr(self, node):
        return self.graph.get_attr(node.target)

    def _call_function(self, node):
        if node.target is aten.sym_size.int:
            return self._sym_size(node)
        if "autopar" not in node.meta or not layout_of(node).outputs or node.target is operator.getitem:
            return self.graph.call_function(node.target, *self._map_args(node))
        return self._compute(node)

    def _output(self, node):
        flat, spec = pytree.tree_flatten(node.args[0])
        outs = []
        for i, v in enumerate(flat):
            if i in self.plan.traced.buffer_mutations:
                buf = self.graph.get_attr(self.plan.traced.buffer_mutations[i])
                self.graph.call_function(aten.copy_.default, (buf, self.env[v]))
                continue
            outs.append(self._user_output(v) if isinstance(v, fx.Node) else v)
        self.graph.output(tuple(outs))

    def _user_output(self, v: fx.Node) -> fx.Node:
        if "autopar" not in v.meta or not layout_of(v).outputs:
            return self.env[v]
        target = self.plan.output_target(layout_of(v).spec)
        x = self.edge(v, target)
        dp = self.plan.batch_axis
        if dp is not None and isinstance(target[dp], Shard) and v.meta["val"].dtype.is_floating_point:
            # a loss taken over this output is each rank's mean: its gradient counts the rank's
            # share of the rows (1/n when pieces are equal; uneven batches weigh by their rows)
            share = self.share(v, x, target[dp].dim, dp)
            factor = 1.0 / self.mesh.shape[dp] if share is None else share
            flag = self.eager_flag()
            x = self.graph.call_function(ops.scale_grad.default, (x, self.mesh.axis_names[dp], factor), {"alias": flag})
        return x

    # --------------------------------------------------------------- arguments
    def _map_args(self, node):
        # fx's map_aggregate (C++) rather than pytree: emission walks every argument of every
        # node once per rank, and pytree's generic walk was a fifth of the emission time.
        def conv(a):
            return self.env[a] if isinstance(a, fx.Node) else a

        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), conv)
        return tuple(args), dict(kwargs)

    def _sym_size(self, node):
        x, dim = node.args
        return self.global_size(x, dim)

    def _local_size(self, size, f: int):
        if f == 1 or (isinstance(size, int) and size == -1):
            return size
        if isinstance(size, int):
            return size // f
        if size in self.scaled and self.scaled[size][1] == f:
            return self.scaled[size][0]
        return self.graph.call_function(operator.floordiv, (size, f))

    def _compute(self, node):
        lay = layout_of(node)
        f_edges = self.plan.flow.f_edges
        local_inputs = [
            self.edge(inp, tgt, f_edges.get((node.name, i), ()), (node, i))
            for i, (inp, tgt) in enumerate(zip(lay.inputs, lay.input_targets))
        ]
        it = iter(local_inputs)
        tensors = set(lay.inputs)

        def conv(a):
            if isinstance(a, fx.Node):
                return next(it) if a in tensors else self.env[a]
            return a

        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), conv)
        args = list(args)
        traits = op_traits(node.target)
        shape_idx = traits.shape_arg
        if shape_idx is not None and shape_idx < len(args):
            spec = lay.spec
            args[shape_idx] = self._local_shape_arg(node, args[shape_idx], spec)
        lowering = lowering_for(lay.strategies)
        if lowering is not None:
            return lowering[0].emit(self, node, tuple(args), dict(kwargs), lowering[1])
        mode = traits.mode or random_lowering(node.target)
        if (
            mode is not None
        ):  # train/eval, dropout (sharding/lowerings/train_modes.py), random ops (sharding/lowerings/random_draws.py)
            lowered = mode(self, node, tuple(args), dict(kwargs))
            if lowered is not None:
                return lowered
        fused = self._fuse_bias(node, args, kwargs)
        if fused is not None:
            return fused
        out = self.graph.call_function(node.target, tuple(args), dict(kwargs))
        return self._weigh_averages(node, lay, local_inputs, out)

    def share(self, node: fx.Node, local: fx.Node, dim: int, axis: int):
        """This rank's share of the rows of ``node``'s dim ``dim`` split on ``axis`` (``local``: its
        piece in the program): a value of the program where pieces differ, else None."""
        size, n = node.meta["val"].shape[dim], self.mesh.shape[axis]
        if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
            if axis not in self.plan.ragged:
                return None
            group, rank = self.rank_value(f"autopar_group_{axis}"), self.rank_value(RANK_ATTR)
            return self.graph.call_function(ragged_share, (local, dim, self.mesh.axis_names[axis], group, rank))
        if not is_uneven(int(size), n):
            return None
        return self.graph.call_function(piece_share, (int(size), n, self.coord(axis)))

    def _weigh_averages(self, node, lay, local_inputs, out):
        """A mean over rows split unevenly (Partial("avg") from a split input) weighs each rank's
        mean by its share of the rows (times the axis size, since the reduction averages): the
        serial mean over every row, not the mean of the ranks' means."""
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return out
        for axis, s in enumerate(lay.strategies):
            if s is None or s.lowering is not None or s.outputs[:1] != (Partial("avg"),):
                continue
            split = next((i for i, p in enumerate(s.inputs) if isinstance(p, Shard)), None)
            if split is None:
                continue
            w = self.share(lay.inputs[split], local_inputs[split], s.inputs[split].dim, axis)
            if w is not None:
                w = self.graph.call_function(operator.mul, (w, float(self.mesh.shape[axis])))
                out = self.graph.call_function(weigh, (out, w))
        return out

    def _local_shape_arg(self, node, sizes, spec) -> list:
        """A view's global sizes made this rank's. Where a split is uneven, a ``-1`` is spelt out
        from the output's static size: a rank holding an empty piece cannot infer it."""
        out = node.meta["val"].shape
        uneven = uneven_dims(out, spec, self.mesh) if isinstance(node.meta["val"], torch.Tensor) else {}
        local = []
        for d, s in enumerate(sizes):
            if uneven and isinstance(s, int) and s == -1 and d < len(out) and not isinstance(out[d], torch.SymInt):
                s = int(out[d])
            local.append(self.piece_of(s, spec, d))
        return local

    def _fuse_bias(self, node, args, kwargs) -> fx.Node | None:
        """linear(x, w) + b -> linear(x, w, b) where nothing runs between the two on this rank.

        Why: trace.split_biases separates every bias so that a row-parallel layer can add its
        bias after the reduction; where no collective ends up in between (column-parallel and
        replicated linears), the fused kernel saves a pass over the output, forward and
        backward, as a hand-written module has it.
        """
        if node.target is not aten.add.Tensor or len(args) != 2 or kwargs:
            return None
        lin, bias = args
        src, bias_src = node.args
        if not (
            isinstance(lin, fx.Node)
            and lin.target is aten.linear.default
            and len(lin.args) == 2
            and not lin.users
            and len(src.users) == 1
            and self.env.get(src) is lin
        ):
            return None  # not a bare linear, used elsewhere, or a collective in between
        if not (
            isinstance(bias, fx.Node)
            and bias.op == "get_attr"
            and isinstance(bias_src, fx.Node)
            and bias_src.meta["val"].dim() == 1
            and bias_src.meta["val"].dtype == src.meta["val"].dtype
        ):
            return None
        lin.args = (*lin.args, bias)
        return lin


# ops whose output is a fresh tensor their backward does not save (their inputs are saved)
_FRESH_OUTPUT = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default}


def _static_shape(node: fx.Node) -> tuple:
    """``node``'s global shape, None for each dim sized at run time (the batch)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ()
    meta = TensorMeta.of(val)
    return tuple(None if dyn else size for size, dyn in zip(meta.shape, meta.dynamic))


# ops whose backward makes the gradient of the inputs at these positions afresh (a matmul of
# the output's gradient; addmm's bias would get the output's gradient itself)
_FRESH_GRAD = {
    aten.linear.default: (0, 1),
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.matmul.default: (0, 1),
}


def _fresh_grad_use(user: fx.Node, node: fx.Node) -> bool:
    positions = _FRESH_GRAD.get(user.target) if user.op == "call_function" else None
    return (
        positions is not None
        and all(i in positions for i, a in enumerate(user.args) if a is node)
        and node not in user.kwargs.values()
    )


@functools.lru_cache(maxsize=4096)
def _steps(src: tuple, dst: tuple) -> tuple:
    """plan_steps, remembered: a pure function of two specs, asked once per edge and rank."""
    return tuple(plan_steps(src, dst))


def _reordered(src: tuple, dst: tuple, axis: int) -> bool:
    """Whether the split on ``axis`` changes its order of pieces only (plan_steps gathers it in one
    order and cuts it in the other: a plain gather, whatever Megatron's f asks of the axis)."""
    s, d = src[axis], dst[axis]
    return isinstance(s, Shard) and isinstance(d, Shard) and s != d and dataclasses.replace(s, order=d.order) == d


def emit_graph(plan) -> fx.Graph:
    """The program every rank runs (see rank_attrs for what differs between ranks)."""
    graph = Emitter(plan).run()
    graph.lint()
    return graph
