"""Expert tensor parallelism: each expert's matmuls split over an axis, Megatron's way, inside
an experts module's chain (blocks.py).

The chain has two grouped matmuls ``grouped_mm(x (M, K), w (E, K, N), offs)``: the first is
split column-parallel (its weight's N dim: fused gate|up weights as ``blocks`` blocks when the
chain chunks its output, so each rank keeps its part of the gate and of the up projection),
the last row-parallel (its weight's K dim), so the chain's output on a rank is its partial sum.
The weights' stored dims are found through the transposes between them and the matmuls. The
placements are checked before they are used: on random rows, the sum over the ranks of the
chain on each rank's pieces must equal the chain on the whole weights.

Example:
    >>> expert_tp_placements(block, 2)     # [S(1,blocks=2), S(2)] for Mixtral's gate_up_proj, down_proj
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.errors import AnnotationError
from autopar.mesh import Mesh
from autopar.placement import Partial, Shard, shard_tensor

aten = torch.ops.aten
CHUNKS = {aten.chunk.default, aten.split.Tensor}
CASTS = {aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.alias.default}


def expert_tp_placements(block, n: int, grouped, through) -> list:
    """Per parameter of ``block`` (in the op's order) its placement on an axis of ``n`` ranks.

    Expert biases (gpt-oss' ``gate_up_proj_bias``, ``down_proj_bias``: ``(E, N)``, gathered by
    each row's expert and added to a grouped matmul's output): the first matmul's is split with
    its weight's N dim (the same blocks), the last one's is replicated and read as ``Partial()``,
    so that it enters the partial sum once (as a ModuleList's row bias, ``_place_linear``)."""
    gm = [node for node in block.chain.graph.nodes if grouped(node)]
    phs = [node for node in block.chain.graph.nodes if node.op == "placeholder"]
    ph, ids = phs[3:], phs[2]
    if len(gm) != 2:
        raise _fail(block, f"its chain has {len(gm)} grouped matmuls; expert tensor parallelism needs up and down")
    found = {}
    for node, w_dim, row in ((gm[0], 2, False), (gm[1], 1, True)):
        bias, out = _stacked_bias(node, ids)
        blocks = 1 if row else _blocks(out)
        param, dim = _source_dim(node.args[1], w_dim, through)
        if param not in ph or bias is not None and (bias not in ph or bias is param):
            raise _fail(block, f"{node.name}'s weight or bias is not one of the module's parameters")
        found[param] = Shard(dim, blocks=blocks) if blocks > 1 else Shard(dim)
        if bias is not None:  # (E, N): split with the weight's N dim, or added once (row)
            found[bias] = Partial() if row else Shard(1, blocks=blocks) if blocks > 1 else Shard(1)
        if not row:
            _check_interleave(block, out, n, blocks)
    if len(found) != len(ph):
        raise _fail(block, "parameters other than the two grouped matmuls' weights and the biases added to them")
    placements = [found[p] for p in ph]
    _check(block, placements, n)
    return placements


def _stacked_bias(node: fx.Node, ids: fx.Node) -> tuple:
    """(the expert bias a grouped matmul's output gets, the node that holds the sum): the one add
    that reads the output with ``bias[ids]`` (each row's expert's bias: gpt-oss); (None, node)."""
    if len(node.users) != 1:
        return None, node
    add = next(iter(node.users))
    if add.target not in (aten.add.Tensor, aten.add_.Tensor) or len(add.args) != 2 or add.kwargs:
        return None, node
    other = add.args[1] if add.args[0] is node else add.args[0]
    while isinstance(other, fx.Node) and other.target in CASTS:
        other = other.args[0]
    if not isinstance(other, fx.Node) or other.target is not aten.index.Tensor or list(other.args[1]) != [ids]:
        return None, node
    return other.args[0], add


def _check_interleave(block, out: fx.Node, n: int, blocks: int) -> None:
    """Gate and up interleaved column by column (gpt-oss: ``gate_up[..., ::2]``, ``[..., 1::2]``):
    a rank's contiguous piece keeps each gate with its up only if it holds whole pairs."""
    val = out.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return
    width = int(val.shape[-1]) // blocks
    for u in out.users:
        step = u.args[4] if u.target is aten.slice.Tensor and len(u.args) > 4 and u.args[1] in (-1, 1) else 1
        if step > 1 and width % (n * step):
            raise _fail(
                block,
                f"its gate and up columns interleave (every {step}th of {width}): split over {n} ranks, a "
                f"rank's piece would part a gate from its up; use a tp axis whose size divides {width // step}",
            )


def _fail(block, why: str) -> AnnotationError:
    return AnnotationError(f"expert_parallel(..., tp=...) on module {block.path!r}: {why}.")


def _blocks(node: fx.Node) -> int:
    """k where the matmul's output is cut into k equal parts on its last dim (gate | up)."""
    for u in node.users:
        if u.target in CHUNKS and (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)) in (-1, 1):
            return u.args[1] if u.target is aten.chunk.default else node.meta["val"].shape[-1] // u.args[1]
    return 1


def _source_dim(w: fx.Node, dim: int, through) -> tuple:
    """(placeholder, its dim) that ``w``'s dim ``dim`` comes from, through transposes and casts."""
    while w.op == "call_function":
        if w.target not in through:
            break
        if w.target is aten.transpose.int:
            a, b = (d % 3 for d in w.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif w.target is aten.permute.default:
            dim = w.args[1][dim] % 3
        elif w.target not in CASTS:
            break  # a view: dims no longer map one to one
        w = w.args[0]
    return w, dim


def _sums_agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether the pieces' sum is the whole's to the rounding of their dtype: a wrong split is off
    by the output's own size, while a bf16 plan (a precision policy traces in its compute dtype)
    rounds each piece's partial sum at 4e-3 of it."""
    tol = max(1e-3, 4 * torch.finfo(want.dtype).eps)
    scale = float(want.abs().max()) if want.numel() else 0.0
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=max(1e-4, tol * scale))


def _check(block, placements, n: int) -> None:
    ph = [node for node in block.chain.graph.nodes if node.op == "placeholder"]
    weights = [node.meta.get("val") for node in ph[3:]]
    if any(not isinstance(v, torch.Tensor) for v in weights):
        return  # no example values (a graph copied without metadata): the placements stand as derived
    g = torch.Generator().manual_seed(1)
    full = [(torch.randn(tuple(int(s) for s in v.shape), generator=g) / 4).to(v.dtype) for v in weights]
    experts = int(full[0].shape[0])
    x = torch.randn(3 * experts, int(ph[0].meta["val"].shape[-1]), generator=g).to(full[0].dtype)
    offs = torch.arange(1, experts + 1, dtype=torch.int32) * 3
    ids = torch.arange(experts).repeat_interleave(3)
    mesh = Mesh((n,), ("x",))
    with torch.no_grad():
        want = block.chain(x, offs, ids, *full)
        pieces = [[shard_tensor(t, (p,), mesh, r) for t, p in zip(full, placements)] for r in range(n)]
        got = sum(block.chain(x, offs, ids, *mine) for mine in pieces)
    if not _sums_agree(got, want):
        raise _fail(block, "its experts do not split column- then row-parallel (the pieces' sum differs)")


# ------------------------------------------------------------------- per-expert ModuleLists
LINEAR = {aten.linear.default}
MATMUL = {aten.mm.default, aten.matmul.default}
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


def list_tp_placements(block, n: int) -> list:
    """Per parameter of one expert of a per-expert ModuleList (``block.expert``'s order) its
    placement on an axis of ``n`` ranks: the linears that read the rows column-parallel (weight
    ``(out, in)`` split on out), the one whose output leaves the expert row-parallel (split on
    in), so that the expert's output on a rank is its partial sum (Mixtral's w1, w3 | w2;
    gate_proj, up_proj | down_proj). Biases: a column linear's is split with its weight
    (``Shard(0)``); the row linear's is replicated and must enter the partial sum once, so the op
    reads it as ``Partial()`` (the R -> P step on its edge: the axis' first rank adds it, the others
    add zeros; its backward is the identity, so every rank gets its whole gradient). Checked as the
    stacked experts' are: on random rows the sum of the pieces' outputs must equal the whole expert's.

    Example:
        >>> list_tp_placements(block, 2)     # Mixtral's w1, w2, w3: [S(0), S(1), S(0)]
        >>> list_tp_placements(block, 2)     # with biases: w1.bias, w1, w2.bias, w2, ...: [S(0), S(0), P, S(1), ...]
    """
    g = block.expert.graph
    ph = [node for node in g.nodes if node.op == "placeholder"][1:]
    mms = [node for node in g.nodes if node.op == "call_function" and node.target in LINEAR | MATMUL]
    out = next(node for node in g.nodes if node.op == "output").args[0]
    last = _last_matmul(out, set(mms))
    if last is None or len(mms) < 2:
        raise _fail(block, f"its expert has {len(mms)} linears; expert tensor parallelism needs up and down ones")
    found: dict = {}
    for node in mms:
        _place_linear(block, node, node is last, ph, found)
    if len(found) != len(ph):
        raise _fail(block, "its expert has parameters other than its linears' weights and biases")
    placements = [found[p] for p in ph]
    _check_list(block, placements, n)
    return placements


def _place_linear(block, node, row: bool, ph, found: dict) -> None:
    """One linear's weight placement on the tp axis (and its bias', if it adds one), into ``found``."""
    if node.target in LINEAR:  # weight (out, in): column splits out (dim 0), row splits in (dim 1)
        param, dim = _source_2d(node.args[1], 1 if row else 0)
    else:  # x @ w, w (in, out): column splits its dim 1, row its dim 0
        param, dim = _source_2d(node.args[1], 0 if row else 1)
    if param not in ph or param in found:
        raise _fail(block, f"{node.name}'s weight is not one of the expert's own parameters (used once)")
    found[param] = Shard(dim)
    bias = _bias(node)
    if bias is None:
        return
    if bias not in ph or bias in found:
        raise _fail(block, f"{node.name}'s bias is not one of the expert's own parameters (used once)")
    found[bias] = Partial() if row else Shard(0)  # row: replicated, added once (on the first rank's part)


def _bias(node: fx.Node):
    """What a linear adds to its output: its bias argument, or the 1-D operand of the one add that
    reads its output (trace.split_biases writes every bias so); None where it adds none."""
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if bias is not None or len(node.users) != 1:
        return bias
    add = next(iter(node.users))
    if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    other = add.args[1] if add.args[0] is node else add.args[0]
    val = other.meta.get("val") if isinstance(other, fx.Node) else None
    return other if isinstance(val, torch.Tensor) and val.dim() == 1 and other.op == "placeholder" else None


def _last_matmul(node, mms: set):
    """The linear whose output reaches ``node`` through elementwise ops only (the down projection)."""
    seen = [node]
    while seen:
        cur = seen.pop()
        if cur in mms:
            return cur
        if isinstance(cur, fx.Node) and cur.op == "call_function":
            seen += [a for a in cur.all_input_nodes if a.op != "placeholder"]
    return None


def _source_2d(w: fx.Node, dim: int) -> tuple:
    """(placeholder, its dim) that a 2-D weight's dim ``dim`` comes from, through transposes and casts."""
    while isinstance(w, fx.Node) and w.op == "call_function" and w.target in TRANSPOSES | CASTS:
        if w.target in TRANSPOSES:
            dim = 1 - dim
        w = w.args[0]
    return w, dim


def _check_list(block, placements, n: int) -> None:
    ph = [node for node in block.expert.graph.nodes if node.op == "placeholder"]
    vals = [node.meta.get("val") for node in ph]
    if any(not isinstance(v, torch.Tensor) for v in vals):
        return
    g = torch.Generator().manual_seed(1)
    full = [(torch.randn(tuple(int(s) for s in v.shape), generator=g) / 4).to(v.dtype) for v in vals[1:]]
    x = torch.randn(5, int(vals[0].shape[-1]), generator=g).to(vals[0].dtype)
    mesh = Mesh((n,), ("x",))
    with torch.no_grad():
        want = block.expert(x, *full)
        pieces = [[shard_tensor(t, (p,), mesh, r) for t, p in zip(full, placements)] for r in range(n)]
        got = sum(block.expert(x, *mine) for mine in pieces)
    if not _sums_agree(got, want):
        raise _fail(block, "its experts do not split column- then row-parallel (the pieces' sum differs)")
