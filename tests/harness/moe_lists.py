"""Per-expert ``nn.ModuleList`` experts, as HF wrote them up to transformers 4.4x (the installed
transformers fuses experts into 3-D weights): Mixtral's ``experts[i].w1/w2/w3`` and
Qwen2-MoE's / OLMoE's ``experts[i].gate_proj/up_proj/down_proj``, each block looping over its
experts with ``torch.where(expert_mask[i])`` and ``index_add_``. ``list_model`` puts such
blocks into the installed HF models (copying the fused experts' weights, so the model computes
what the fused one does); its expert parameters are ``model.layers.0.mlp.experts.3.w1.weight``.

>>> model, kw = list_model("mixtral")       # 1 layer, 4 experts of w1/w2/w3, top-2
>>> ap.plan(model, mesh, kwargs=kw, annotations=EP, data_parallel="dp", dynamic=False)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from tests.harness import moe as M

EP = M.EP  # {"model.layers.*.mlp.experts": ap.expert_parallel("dp")}
EP_ROUTED = {"experts": ap.expert_parallel("dp")}  # RoutedListExperts' list
LIST_KINDS = ("mixtral", "qwen2_moe", "olmoe")


# ------------------------------------------------------------------ HF's code (transformers 4.4x)
class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, hidden, ffn, bias=False):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, ffn, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        current_hidden_states = self.w2(current_hidden_states)
        return current_hidden_states


class GatedMLP(nn.Module):
    """Qwen2MoeMLP / OlmoeMLP."""

    def __init__(self, hidden, ffn, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock / OlmoeSparseMoeBlock of transformers 4.4x
    (returning the hidden states only, as the installed decoder layers expect). ``bias``: the
    experts' linears with biases (random, as nn.Linear initialises them)."""

    def __init__(self, kind, hidden, ffn, experts, top_k, norm_topk_prob, shared_ffn=0, bias=False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, experts, bias=False)
        mlp = MixtralBlockSparseTop2MLP if kind == "mixtral" else GatedMLP
        self.experts = nn.ModuleList([mlp(hidden, ffn, bias) for _ in range(experts)])
        if shared_ffn:
            self.shared_expert = GatedMLP(hidden, shared_ffn)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(hidden_states)
            final_hidden_states = final_hidden_states + F.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


# ------------------------------------------------------------------------------ the models
def _qwen2_moe_config():
    import transformers as T

    return T.Qwen2MoeConfig(
        **M.COMMON,
        intermediate_size=M.FFN,
        moe_intermediate_size=M.FFN,
        shared_expert_intermediate_size=M.FFN,
        num_experts=M.EXPERTS,
        num_experts_per_tok=M.TOP_K,
        norm_topk_prob=False,
    )


def list_model(kind: str, seed: int = 0, batch: int = 4, seq: int = 8, bias: bool = False):
    """(an installed HF causal LM whose MoE blocks have per-expert ModuleList experts, example
    kwargs with labels). The blocks take the fused model's weights: the same function (with
    ``bias``, plus the experts' linears' biases, drawn after the seed)."""
    import transformers as T

    if kind == "qwen2_moe":
        torch.manual_seed(seed)
        model = T.Qwen2MoeForCausalLM._from_config(_qwen2_moe_config(), attn_implementation="eager").eval()
        g = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(0, M.VOCAB, (batch, seq), generator=g)
        kw = {"input_ids": ids, "labels": torch.randint(0, M.VOCAB, (batch, seq), generator=g)}
    else:
        model, kw = M.moe_model(kind, seed, batch, seq)
    cfg = model.config
    norm = getattr(cfg, "norm_topk_prob", kind == "mixtral")
    for layer in model.model.layers:
        fused = layer.mlp
        shared = M.FFN if kind == "qwen2_moe" else 0
        block = SparseMoeBlock(kind, M.HIDDEN, M.FFN, M.EXPERTS, M.TOP_K, norm or kind == "mixtral", shared, bias)
        with torch.no_grad():
            block.gate.weight.copy_(fused.gate.weight)
            for i, expert in enumerate(block.experts):
                gate, up = fused.experts.gate_up_proj[i].chunk(2, dim=0)
                first, second, down = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
                getattr(expert, first).weight.copy_(gate)
                getattr(expert, second).weight.copy_(up)
                getattr(expert, down).weight.copy_(fused.experts.down_proj[i])
            if shared:
                block.shared_expert.load_state_dict(fused.shared_expert.state_dict())
                block.shared_expert_gate.load_state_dict(fused.shared_expert_gate.state_dict())
        layer.mlp = block
    return model, kw


class RoutedListExperts(nn.Module):
    """HF's per-expert loop (transformers 4.4x) over a ModuleList, fed a given routing (the last
    expert never chosen: moe.routing), then a linear: the loop alone, without a router's top-k
    whose ties float noise could flip. ``bias``: experts whose linears have biases."""

    def __init__(self, kind: str = "mixtral", seed: int = 0, bias: bool = False):
        super().__init__()
        model, _ = list_model(kind, seed, bias=bias)
        self.experts = model.model.layers[0].mlp.experts
        self.out = nn.Linear(M.HIDDEN, M.HIDDEN)

    def forward(self, x, index, weights):
        final = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(index, num_classes=len(self.experts)).permute(2, 1, 0)
        for expert_idx in range(len(self.experts)):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current = self.experts[expert_idx](x[None, top_x].reshape(-1, x.shape[-1])) * weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(x.dtype))
        return self.out(final)
