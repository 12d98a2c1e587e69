"""The eager attention form, matmul-softmax-matmul, as one scaled_dot_product_attention node.

HF's ``attn_implementation="eager"`` and nanoGPT-style models compute attention op by op:

    s = q @ k.transpose(-2, -1)  [* scale | / d]  [+ additive mask | .masked_fill(~keep, -inf)]
    p = softmax(s, -1)  [.to(dtype)]  [dropout(p=0 or eval)]
    y = p @ v

The rules place each op alone and a sequence split on a mesh axis cannot survive the first
matmul cheaply, so context parallel (context/technique.py) rewrites each recognised
chain, before planning, into ``aten.scaled_dot_product_attention(q, k, v, attn_mask, scale=...)``
(the same value: the boolean mask is the kept pairs, the additive one is added to the scores),
which its rule and lowering place on the split sequence. A chain with attention dropout
(p > 0 in training) or any other op between is left as traced.

Example:
    >>> fuse_eager_attention(traced)   # -> the number of chains rewritten
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
# gm.meta mark of a trace whose chains were rewritten (a precision policy's second trace follows it,
# whichever plan of the trace asks: parallel/dtype_retarget.py)
FUSED_ATTENTION = "autopar_fused_attention"
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
_MATMUL = (aten.matmul.default,)


def _is_assert(node: fx.Node) -> bool:
    return "assert" in getattr(node.target, "__name__", "")


def _last_dims_swapped(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.transpose.int:
        return False
    nd = node.args[0].meta["val"].dim()
    return {node.args[1] % nd, node.args[2] % nd} == {nd - 2, nd - 1}


def _match(end: fx.Node):
    """(q, k, v, mask, scale, chain nodes) of the chain ending at matmul ``end``, or None."""
    p, v = end.args[0], end.args[1]
    node = p
    chain = []
    if node.target is aten.dropout.default:
        if node.args[1] != 0.0 and (len(node.args) < 3 or node.args[2]):
            return None  # attention dropout in training: its draws are the rank's own
        chain.append(node)
        node = node.args[0]
    while node.op == "call_function" and node.target in _CASTS:
        chain.append(node)
        node = node.args[0]
    if node.target not in _SOFTMAX or (node.args[1] % node.meta["val"].dim()) != node.meta["val"].dim() - 1:
        return None
    chain.append(node)
    s = node.args[0]
    mask = None
    if s.target is aten.masked_fill.Scalar and s.args[2] == float("-inf"):
        fill = s.args[1]
        mask = ("not", fill)
        chain.append(s)
        s = s.args[0]
    elif s.target is aten.add.Tensor and isinstance(s.args[1], fx.Node):
        mask = ("add", s.args[1])
        chain.append(s)
        s = s.args[0]
    scale = 1.0
    if s.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(s.args[1], (int, float)):
        scale = float(s.args[1]) if s.target is aten.mul.Tensor else 1.0 / float(s.args[1])
        chain.append(s)
        s = s.args[0]
    if s.target not in _MATMUL or not _last_dims_swapped(s.args[1]):
        return None
    chain += [s, s.args[1]]
    q, k = s.args[0], s.args[1].args[0]
    qv, kv, vv = (x.meta["val"] for x in (q, k, v))
    if qv.dim() < 3 or kv.shape != vv.shape or qv.shape[:-2] != kv.shape[:-2] or qv.dim() != kv.dim():
        return None
    return q, k, v, mask, scale, chain


def fuse_eager_attention(traced) -> int:
    """Rewrite every recognised eager attention chain of ``traced.gm`` into one SDPA node."""
    graph = traced.gm.graph
    done = 0
    for end in [n for n in graph.nodes if n.op == "call_function" and n.target in _MATMUL]:
        found = _match(end)
        if found is None:
            continue
        q, k, v, mask, scale, chain = found
        with graph.inserting_before(end):
            attn_mask = None
            if mask is not None and mask[0] == "not":
                attn_mask = graph.call_function(aten.bitwise_not.default, (mask[1],))
                attn_mask.meta = dict(mask[1].meta)
                attn_mask.meta["val"] = torch.bitwise_not(mask[1].meta["val"])
            elif mask is not None:
                attn_mask = mask[1]
            # the scale always given: an unscaled chain is scale 1, not SDPA's default 1/sqrt(E)
            fused = graph.call_function(SDPA, (q, k, v, attn_mask), {"scale": scale})
        fused.meta = dict(end.meta)
        end.replace_all_uses_with(fused)
        graph.erase_node(end)
        for node in chain:  # the chain's ops nothing else reads (and their metadata asserts)
            if all(_is_assert(u) for u in node.users):
                for u in list(node.users):
                    graph.erase_node(u)
                graph.erase_node(node)
        done += 1
    if done:
        graph.lint()
        traced.gm.recompile()
        traced.gm.meta[FUSED_ATTENTION] = True
    return done
