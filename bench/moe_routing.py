"""Is Qwen3Moe's survey row under the bf16 policy off by its routing only? (bench/SURVEY_BF16.md)

On tp=2 the plan's expert gradients land 19% from the serial bf16 recipe's. The claim: a router's
top-k flips where tp's bf16 rounding (a row-parallel layer's partial sums rounded before their
all-reduce) moves two near-equal router probabilities past each other, sending a token to another
expert: a discontinuity, not a wrong program. The check: the survey's row run twice, as HF writes
the router and with the routes pinned (each token's experts a fixed function of its position, the
gate values still the router's softmax at those experts, so the router still trains). Pinned,
serial and plan route alike; if the row then passes, routing was the only difference.

    $ PYTHONPATH=. python -m bench.moe_routing
    as written: equal False ... / routes pinned: equal True, max rel ...
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F


def pinned_forward(self, hidden_states):
    """Qwen3MoeTopKRouter.forward with the top-k chosen by position: token t takes experts
    (5t + 3j) mod E for j < k (distinct where 3 and E are coprime), weighted by the router's
    softmax there (renormalised as the router does)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    t = torch.arange(hidden_states.shape[0], device=hidden_states.device)[:, None]
    j = torch.arange(self.top_k, device=hidden_states.device)[None, :]
    router_indices = (5 * t + 3 * j) % self.num_experts
    router_top_value = router_probs.gather(-1, router_indices)
    if self.norm_topk_prob:
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value.to(router_logits.dtype), router_indices


def main() -> None:
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    from bench.survey import run_one

    keys = ("bf16_equal", "bf16_max_rel", "bf16_cause")
    written = run_one("Qwen3MoeForCausalLM", "bf16")
    print("as written:", json.dumps({k: written.get(k) for k in keys}))
    qm.Qwen3MoeTopKRouter.forward = pinned_forward
    pinned = run_one("Qwen3MoeForCausalLM", "bf16")
    print("routes pinned:", json.dumps({k: pinned.get(k) for k in keys}))


if __name__ == "__main__":
    main()
