"""MoE expert matmuls: grouped matmuls over token rows sorted by expert.

``grouped_mm(x (S, K), w (E, K, N), offs (E,)) -> (S, N)``: rows ``offs[e-1]:offs[e]`` of x are
multiplied by expert e's matrix ``w[e]`` (``offs`` holds cumulative row counts). HuggingFace's
MoE blocks (Mixtral, Qwen3-MoE, OLMoE, ...) run their experts through it: ``aten._grouped_mm``
in bf16, its own custom op ``transformers::grouped_mm_fallback`` otherwise (what torch.export
records on CPU). Strategies, per mesh axis:

- experts split (expert parallelism): w S(0), x and offs replicated -> out Partial. Each rank
  holds E/n experts and computes only the rows routed to them (lowering ``local_experts``);
  the rows of other ranks' experts are zero, so the sum over ranks is the serial output.
- every expert column-parallel: w S(2) -> out S(1); row-parallel: x S(1), w S(1) -> Partial.
- a partial x times a replicated w stays partial (the op is linear in x).
The token rows (dim 0 of x) are never split: ``offs`` indexes them globally.

Example:
    >>> grouped_mm_rule(op)   # x (64, 32), w (4, 32, 128) -> [..., x R, w S(0) -> P via local_experts]
"""

from __future__ import annotations

import torch

from autopar.parallel.experts.local_experts import LOCAL_EXPERTS
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register, register_by_name

aten = torch.ops.aten
R = Replicate()
FALLBACK = "transformers::grouped_mm_fallback"


def grouped_mm_rule(op: OpInfo) -> list[Strategy]:
    x, w = op.tensors[0], op.tensors[1]
    offs = op.arg(2, "offs")
    if x.ndim != 2 or w.ndim != 3 or offs is None or op.arg(3, "bias") is not None:
        return [op.replicated()]  # the batched (3-D x) and biased forms: not split yet
    strategies = [op.replicated()]
    if w.shape[0] > 1:
        strategies.append(
            op.strategy(
                {w: Shard(0)}, Partial(), lowering=LOCAL_EXPERTS, note="experts split: each rank runs its experts' rows"
            )
        )
    if w.shape[2] > 1:
        strategies.append(op.strategy({w: Shard(2)}, Shard(1), note="every expert column-parallel"))
    if w.shape[1] > 1:
        strategies.append(op.strategy({x: Shard(1), w: Shard(1)}, Partial(), note="every expert row-parallel"))
    strategies.append(op.strategy({x: Partial()}, Partial(), note="linear in x"))
    return strategies


register(aten._grouped_mm.default)(grouped_mm_rule)
register_by_name(FALLBACK)(grouped_mm_rule)
