"""Each op's seconds on one rank as the rank module runs: eager or compiled, bf16 or Float8 Linears.

Eager (the default), op_time's roofline per op. ``profile.compiled``: the memory-bound ops take
their fused regions' bytes (cost/fusion.py) instead of their eager kernels' (``"blocks"``: only
inside the repeated blocks, each compiled on its own as torchtitan does; the rest eager). ``profile.float8``:
the converted Linears' matmuls (cost/float8.py) run at ``flops_per_s * fp8_ratio`` and their
casts' bytes are added at the memory bandwidth (FSDP's fp8 gather of their weights is in the
search's parameter terms), and their scales' amax all-reduces at their links' latency
(``scale_seconds``; with ap.Float8 in the plan, only the fp8 gather's, which plan.collectives()
lists over several axes at once: the casts' own are in its per-axis activation collectives).
``profile`` is any object with a Profile's fields (search/profiles.py: cost does not import search).

Example:
    >>> [(name, fwd, bwd) for name, fwd, bwd, grad in op_seconds(plan, Numbers(plan.mesh), profile)][:2]
"""

from __future__ import annotations

from autopar.cost.float8 import cast_bytes, float8_linears, scale_seconds
from autopar.cost.fusion import fused_bytes
from autopar.cost.op_time import node_seconds
from autopar.sharding.propagate import layout_of


def op_seconds(plan, sy, profile) -> list[tuple]:
    """(node name, forward s, backward s, needs a gradient) of each op of ``plan``."""
    grads, bandwidth = plan.ctx.needs_grad, profile.memory_bandwidth
    compiled = getattr(profile, "compiled", False)  # True: the rank module; "blocks": each repeated block
    fused = fused_bytes(plan, sy, blocks_only=compiled == "blocks") if compiled and bandwidth else {}
    float8 = getattr(profile, "float8", False)
    fp8 = float8_linears(plan) if float8 else {}
    casts = cast_bytes(plan, sy, bool(fused), fsdp_shards(plan)) if float8 and bandwidth else {}
    # the scales' amax all-reduces (cost/float8.py): latency-bound messages beside each Linear
    converted = float8 or getattr(plan.options, "float8", None) is not None
    scales = scale_seconds(plan, profile) if converted and hasattr(profile, "link") else {}
    out = []
    for node in plan.graph.nodes:
        if node.op != "call_function" or "autopar" not in node.meta or not layout_of(node).outputs:
            continue
        grad = bool(grads.get(node))
        rate = profile.flops_per_s * (profile.fp8_ratio if node.name in fp8 else 1.0)
        attention = None if node.name in fp8 else profile.attention_flops_per_s
        fwd, bwd = node_seconds(node, sy, rate, bandwidth, grad, grads, attention, fused.get(node.name))
        if node.name in casts:  # the casts are kernels of their own (memory-bound), beside the matmul
            fwd += casts[node.name][0] / bandwidth
            bwd += casts[node.name][1] / bandwidth if grad else 0.0
        if node.name in scales:
            fwd += scales[node.name][0]
            bwd += scales[node.name][1] if grad else 0.0
        out.append((node.name, fwd, bwd, grad))
    return out


def fsdp_shards(plan) -> float:
    """How many ranks zero=3 shards a parameter over (1 without zero=3): a Float8 weight gathered
    by FSDP is cast on each rank's shard before the gather."""
    shards = plan.weight_shards
    return 1.0 if shards is None else float(shards[1])
