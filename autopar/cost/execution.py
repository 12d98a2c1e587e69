"""Each op's seconds on one rank as the rank module runs: eager or compiled, bf16 or Float8 Linears.

Eager (the default), op_time's roofline per op. ``profile.compiled``: the memory-bound ops take
their fused regions' bytes (cost/fusion.py) instead of their eager kernels' (``"blocks"``: only
inside the repeated blocks, each compiled on its own as torchtitan does; the rest eager). What a
technique changes in an op's seconds it says itself (``OpExtra``, from each technique class's
``op_extras`` hook, parallel/protocols/cost.py: the classes are handed in, cost does not import
parallel): under ``profile.float8`` the converted Linears' matmuls (parallel/float8/cost.py) run
at ``flops_per_s * fp8_ratio`` and their casts' bytes are added at the memory bandwidth (FSDP's
fp8 gather of their weights is in the search's parameter terms), and their scales' amax
all-reduces at their links' latency (``scale_seconds``; with ap.Float8 in the plan, only the fp8
gather's, which plan.collectives() lists over several axes at once: the casts' own are in its
per-axis activation collectives). ``profile`` is any object with a Profile's fields
(search/profiles.py: cost does not import search).

Example:
    >>> from autopar.parallel import TECHNIQUES
    >>> [(n, fwd, bwd) for n, fwd, bwd, grad in op_seconds(plan, Numbers(plan.mesh), profile, TECHNIQUES.values())][:2]
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.fusion import fused_bytes
from autopar.cost.op_time import node_seconds
from autopar.sharding.propagate import layout_of


@dataclass(frozen=True)
class OpExtra:
    """What a technique changes in one op's seconds on a rank (its ``op_extras`` hook): ``rate``,
    its FLOPs' rate times this (float8's fp8 matmuls; None: unchanged), ``nbytes``, (forward,
    backward) bytes of kernels of its own beside the op, at the memory bandwidth (float8's casts),
    and ``seconds``, (forward, backward) seconds beside it (latency-bound collectives: float8's
    scales). The backward's only where the op needs a gradient."""

    rate: float | None = None
    nbytes: tuple | None = None
    seconds: tuple | None = None


def op_seconds(plan, sy, profile, techniques) -> list[tuple]:
    """(node name, forward s, backward s, needs a gradient) of each op of ``plan``; ``techniques``:
    the registered technique classes (parallel.TECHNIQUES.values()), asked for their ``op_extras``."""
    grads, bandwidth = plan.ctx.needs_grad, profile.memory_bandwidth
    compiled = getattr(profile, "compiled", False)  # True: the rank module; "blocks": each repeated block
    fused = fused_bytes(plan, sy, blocks_only=compiled == "blocks") if compiled and bandwidth else {}
    extras: dict[str, list] = {}
    for cls in techniques:
        for name, extra in cls.op_extras(plan, sy, profile, bool(fused)).items():
            extras.setdefault(name, []).append(extra)
    out = []
    for node in plan.graph.nodes:
        if node.op != "call_function" or "autopar" not in node.meta or not layout_of(node).outputs:
            continue
        grad = bool(grads.get(node))
        mine = extras.get(node.name)
        if not mine:  # most ops: no technique changes them (a search costs ~40,000 op-plans)
            rate, attention = profile.flops_per_s, profile.attention_flops_per_s
            fwd, bwd = node_seconds(node, sy, rate, bandwidth, grad, grads, attention, fused.get(node.name))
            out.append((node.name, fwd, bwd, grad))
            continue
        rate, attention = profile.flops_per_s, profile.attention_flops_per_s
        for e in mine:
            if e.rate is not None:
                rate, attention = rate * e.rate, None
        fwd, bwd = node_seconds(node, sy, rate, bandwidth, grad, grads, attention, fused.get(node.name))
        for e in mine:  # the casts are kernels of their own (memory-bound), beside the matmul
            if e.nbytes is not None:
                fwd += e.nbytes[0] / bandwidth
                bwd += e.nbytes[1] / bandwidth if grad else 0.0
        for e in mine:  # latency-bound messages beside the op (float8's scales' amax all-reduces)
            if e.seconds is not None:
                fwd += e.seconds[0]
                bwd += e.seconds[1] if grad else 0.0
        out.append((node.name, fwd, bwd, grad))
    return out
