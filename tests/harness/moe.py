"""Tiny HF mixture-of-experts models (random weights, no download), their experts modules fed a
chosen routing, and training them serially and on every rank (AdamW) for the expert-parallel tests.

>>> model, kw = moe_model("mixtral")              # 1 layer, 4 experts, top-2, hidden 32
>>> plan = ap.plan(model, mesh, kwargs=kw, annotations=EP, data_parallel="dp", dynamic=False)
"""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks

VOCAB, HIDDEN, FFN, EXPERTS, TOP_K = 128, 32, 16, 4, 2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
    tie_word_embeddings=False,
)
EP = {"model.layers.*.mlp.experts": ap.expert_parallel("dp")}


def _config(kind: str):
    import transformers as T

    if kind == "mixtral":
        return T.MixtralConfig(**COMMON, intermediate_size=FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    if kind == "qwen3_moe":
        return T.Qwen3MoeConfig(
            **COMMON,
            intermediate_size=FFN,
            moe_intermediate_size=FFN,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=True,
            head_dim=8,
        )
    if kind == "olmoe":
        return T.OlmoeConfig(**COMMON, intermediate_size=FFN, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    if kind == "deepseek_v3":
        common = {**COMMON, "num_key_value_heads": 4}
        return T.DeepseekV3Config(
            **common,
            intermediate_size=FFN,
            moe_intermediate_size=FFN,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    if kind == "gpt_oss":  # stacked experts with biases, gate|up interleaved, a clamped gate
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        return T.GptOssConfig(
            **COMMON,
            intermediate_size=FFN,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            head_dim=8,
            rope_parameters=rope,
        )
    raise KeyError(kind)


KINDS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",  # not in KINDS: its own tests
}


def moe_model(kind: str, seed: int = 0, batch: int = 4, seq: int = 8):
    """(model, example kwargs with labels). DeepSeek-V3's expert bias keeps the last expert
    from ever being chosen (aux-free routing's bias, pushed far down): one expert gets no token."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = _config(kind)
    model = getattr(T, CLASSES[kind])._from_config(cfg, attn_implementation="eager").eval()
    assert model.config._experts_implementation == "grouped_mm", model.config._experts_implementation
    if kind == "deepseek_v3":
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias[-1] = -1e4
    if kind == "gpt_oss":
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("_bias") and ".experts." in n:
                    p.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return model, {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, seq), generator=g)}


class RoutedExperts(torch.nn.Module):
    """An HF experts module fed a given routing (tokens x top-k indices and weights): the
    routing the test chooses, unbalanced on purpose, instead of a router's."""

    def __init__(self, kind: str, seed: int = 0):
        super().__init__()
        model, _ = moe_model(kind, seed)
        self.experts = model.model.layers[0].mlp.experts
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, index, weights):
        return self.out(self.experts(x, index, weights))


def routing(tokens: int, seed: int = 0, skip: int = EXPERTS - 1):
    """(x, index, weights) for ``tokens`` tokens; expert ``skip`` never chosen, the others unevenly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    choices = [e for e in range(EXPERTS) if e != skip]
    probs = torch.tensor([4.0, 2.0, 1.0][: len(choices)] + [1.0] * (len(choices) - 3))
    index = torch.stack([torch.multinomial(probs, TOP_K, generator=g) for _ in range(tokens)])
    index = torch.tensor(choices)[index]
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1)
    return x, index, weights


def loss_of(out):
    """The loss of a forward's output: HF's own (labels given), or a fixed function of a tensor."""
    if isinstance(out, torch.Tensor):
        return out.sin().square().mean() + out.mean()
    return out["loss"] if isinstance(out, dict) else out[0]


def train_serial(model, batches: list, steps: int = 3, lr: float = 0.01, eps: float = 1e-8):
    """AdamW steps on the serial model; its parameters after them."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, eps=eps)
    for b in batches[:steps]:
        out = model(*b) if isinstance(b, tuple) else model(**b)
        loss_of(out).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_ranks(plan, batches: list, steps: int = 3, lr: float = 0.01, eps: float = 1e-8, routes=None):
    """The same AdamW steps on every rank (simulated); the merged parameters. ``routes``: a dict
    that gets {rank: [the top-k indices each MoE layer's dispatch routed, in call order]}."""

    def rank_steps(rank):
        module = plan.build_module(rank)
        if routes is not None:
            _record_routes(module, routes)
        opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.1, eps=eps)
        for b in batches[:steps]:
            args, kwargs = plan.local_inputs(rank, *b) if isinstance(b, tuple) else plan.local_inputs(rank, **b)
            loss_of(module(*args, **kwargs)).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    return plan.merge_state_dicts(run_ranks(plan.mesh.size, rank_steps))


def _record_routes(module, routes: dict) -> None:
    """Wrap the route step (parallel/experts/moe_dispatch.route) the rank program calls, once for the
    program's code (shared by the ranks' threads, named autopar-rank<r> by the simulator)."""
    import threading

    names = module.forward.__globals__
    key = next(k for k in names if k.endswith("moe_dispatch_route"))
    if getattr(names[key], "recording", None) is routes:
        return
    route = getattr(names[key], "inner", names[key])

    def recorded(hidden, index, experts):
        rank = int(threading.current_thread().name.removeprefix("autopar-rank"))
        routes.setdefault(rank, []).append(index.detach().clone())
        return route(hidden, index, experts)

    recorded.recording, recorded.inner = routes, route
    names[key] = recorded


def serial_routes(model, batches: list, steps: int = 3, lr: float = 0.01, eps: float = 1e-8) -> list:
    """The top-k indices the serial model's routers chose at each of the AdamW steps (a hook on
    each MoE block's experts module, which HF calls with them)."""
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: seen.append(args[1].detach().clone()))
        for name, m in model.named_modules()
        if name.endswith("mlp.experts")
    ]
    train_serial(model, batches, steps, lr, eps)
    for h in hooks:
        h.remove()
    return seen


def other_experts(rank_routes: list, serial: list) -> int:
    """Tokens whose set of chosen experts differs from serial's: ``rank_routes`` the dp ranks'
    indices of one call each (in dp order, their rows in batch order), ``serial`` that call's."""
    ranks = torch.cat(rank_routes)
    return int((ranks.sort(-1).values != serial.sort(-1).values).any(-1).sum())


class LossLM(torch.nn.Module):
    """An HF causal LM called with positional (ids, labels), returning its loss (for the pipeline)."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids, labels):
        return self.m(input_ids=ids, labels=labels).loss


def mixtral_lm(layers: int = 2, batch: int = 8):
    """A ``layers``-layer Mixtral as a LossLM (eager attention), its batch (ids, labels) and kwargs."""
    import transformers as T

    torch.manual_seed(0)
    cfg = _config("mixtral")
    cfg.num_hidden_layers = layers
    model = LossLM(T.MixtralForCausalLM._from_config(cfg, attn_implementation="eager").eval())
    _, kw = moe_model("mixtral", batch=batch)
    return model, (kw["input_ids"], kw["labels"]), kw


def assert_pipeline_steps_equal_serial(plan, model, batch, eps: float = 1e-8, steps: int = 4) -> None:
    """Every rank's pipeline loss equals the serial model's at each of ``steps`` AdamW steps (so the
    first ``steps - 1`` updates equal serial too)."""
    import copy

    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    serial = copy.deepcopy(model)
    opts = [torch.optim.AdamW(r.parameters(), lr=0.01, weight_decay=0.1, eps=eps) for r in runners]
    sopt = torch.optim.AdamW(serial.parameters(), lr=0.01, weight_decay=0.1, eps=eps)

    def step(r):
        loss = runners[r].step(batch)
        opts[r].step()
        opts[r].zero_grad()
        return float(loss)

    for _ in range(steps):
        losses = run_ranks(plan.mesh.size, step)
        want = serial(*batch)
        want.backward()
        sopt.step()
        sopt.zero_grad()
        assert losses == pytest.approx([want.item()] * plan.mesh.size, rel=1e-5)
