"""Expert tensor parallelism: each expert's matmuls split over an axis, Megatron's way, inside
an experts module's chain (sharding/expert_blocks.py).

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
from autopar.placement import Shard, shard_tensor

aten = torch.ops.aten
CHUNKS = {aten.chunk.default, aten.split.Tensor}


def expert_tp_placements(block, n: int, grouped, through) -> list:
    """Per parameter of ``block`` (in the op's order) its placement on an axis of ``n`` ranks."""
    gm = [node for node in block.chain.graph.nodes if grouped(node)]
    ph = [node for node in block.chain.graph.nodes if node.op == "placeholder"][3:]
    if len(gm) != 2:
        raise _fail(block, f"its chain has {len(gm)} grouped matmuls; expert tensor parallelism needs up and down")
    found = {}
    for node, w_dim, blocks in ((gm[0], 2, _blocks(gm[0])), (gm[1], 1, 1)):
        param, dim = _source_dim(node.args[1], w_dim, through)
        if param not in ph:
            raise _fail(block, f"{node.name}'s weight is not one of the module's parameters")
        found[param] = Shard(dim, blocks=blocks) if blocks > 1 else Shard(dim)
    if len(found) != len(ph):
        raise _fail(block, "parameters other than the two grouped matmuls' weights")
    placements = [found[p] for p in ph]
    _check(block, placements, n)
    return placements


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
        elif w.target not in (aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.alias.default):
            break  # a view: dims no longer map one to one
        w = w.args[0]
    return w, dim


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
    if not torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-4):
        raise _fail(block, "its experts do not split column- then row-parallel (the pieces' sum differs)")
