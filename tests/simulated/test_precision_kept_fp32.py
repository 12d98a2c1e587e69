"""HF's keep-in-fp32 modules under the precision policy (issue 41).

A HuggingFace model names the parameters its code reads in fp32: ``_keep_in_fp32_modules_strict``
(kept fp32 under bf16 and fp16) and ``_keep_in_fp32_modules`` (under fp16 only), as
``from_pretrained(dtype=...)`` loads them. Inkling2's router reads ``F.linear(hidden.float(),
weight)``: with the weight cast to bf16, as FSDP2's recipe casts every parameter, the serial recipe
and the plan both fail ("expected m1 and m2 to have the same dtype"). The policy now leaves them in
fp32: traced in fp32 (trace/in_dtype.kept_in_fp32), read without the cast (zero 0-2, no data
parallel), gathered in fp32 in a bucket of their own (zero=3), and not counted as bf16 copies.

The model here is a tiny HF ``PreTrainedModel`` declaring both lists: a router read as Inkling2
reads its own (fp32 activations times the fp32 weight), a gated MLP, a head. Held against the
serial recipe with the same kept parameters (trace/in_dtype.policy_params): loss and every
gradient, on dp, tp, dp x tp and at each zero level. Measured: losses within 1e-6 relative,
gradients within 1.2e-2 of the reference's norm (bf16 noise: a tp layer's partial sums rounded
before their all-reduce), the router's within 1e-6 on dp (it computes in fp32 on every rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar as ap
from autopar.parallel.data_parallel.fsdp_layout import buckets_cached
from autopar.runtime.simulator import run_ranks
from autopar.trace.in_dtype import kept_in_fp32, policy_params

BF16 = torch.bfloat16
GRAD_REL = 3e-2  # bf16 sums in another order (tensor parallelism's partial sums); see the module text


def _model(seed=0):
    from transformers import PretrainedConfig, PreTrainedModel

    class KeptConfig(PretrainedConfig):
        model_type = "autopar_kept_fp32"

        def __init__(self, vocab_size=64, hidden_size=16, experts=4, **kw):
            self.vocab_size, self.hidden_size, self.experts = vocab_size, hidden_size, experts
            super().__init__(**kw)

    class Router(nn.Module):
        def __init__(self, hidden, experts):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)

        def forward(self, h):  # as Inkling2's router: fp32 activations times the (kept) fp32 weight
            return F.linear(h.float(), self.weight).softmax(-1)

    class KeptModel(PreTrainedModel):
        config_class = KeptConfig
        _keep_in_fp32_modules_strict = ["router"]
        _keep_in_fp32_modules = ["head"]  # HF keeps it in fp32 under fp16 only

        def __init__(self, config):
            super().__init__(config)
            h = config.hidden_size
            self.embed = nn.Embedding(config.vocab_size, h)
            self.router = Router(h, config.experts)
            self.up = nn.Linear(h, 4 * h)
            self.down = nn.Linear(4 * h, h)
            self.norm = nn.LayerNorm(h)
            self.head = nn.Linear(h, config.vocab_size, bias=False)

        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            gate = self.router(x)[..., :1].to(x.dtype)
            x = x + gate * self.down(F.gelu(self.up(x)))
            h = self.norm(x)  # as T5 reads its kept ``wo``: the activations cast to the weight's dtype
            logits = self.head(h.to(self.head.weight.dtype))
            return {"loss": F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())}

    torch.manual_seed(seed)
    model = KeptModel(KeptConfig())
    with torch.no_grad():  # HF's init leaves some weights zero: random ones, so every gradient counts
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def _reference(model, kw, dtype):
    """(loss, fp32 gradients) of the serial recipe: ``dtype`` copies of the parameters, the kept
    ones as they are."""
    loss = torch.func.functional_call(model, policy_params(model, dtype), (), kw)["loss"]
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
    return loss.item(), dict(zip(names, grads))


def _step(plan, kw):
    def one(rank):
        module = plan.build_module(rank)
        _, local = plan.local_inputs(rank, **kw)
        loss = module(**local)["loss"]
        loss.backward()
        return loss.item(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}, module

    out = run_ranks(plan.mesh.size, one)
    return out[0][0], plan.merge_state_dicts([o[1] for o in out]), [o[2] for o in out]


def test_kept_names_follow_hf():
    """strict: kept under bf16 and fp16; the plain list: under fp16 only; nothing without a policy."""
    model = _model()
    assert kept_in_fp32(model, BF16) == {"router.weight"}
    assert kept_in_fp32(model, torch.float16) == {"router.weight", "head.weight"}
    assert kept_in_fp32(model, None) == frozenset() == kept_in_fp32(model, torch.float32)
    low = policy_params(model, BF16)
    assert low["router.weight"].dtype == torch.float32 and low["up.weight"].dtype == BF16


def _plans(model, kw):
    tp = {"up": ap.colwise("tp"), "down": ap.rowwise("tp")}
    policy = ap.MixedPrecision(param_dtype=BF16)
    yield (
        "dp=2 zero=3",
        ap.plan(
            model, ap.Mesh((2,), ("dp",)), kwargs=kw, data_parallel=ap.DataParallel("dp", zero=3, param_dtype=BF16)
        ),
    )
    yield (
        "dp=2 zero=0",
        ap.plan(
            model, ap.Mesh((2,), ("dp",)), kwargs=kw, data_parallel=ap.DataParallel("dp", zero=0, param_dtype=BF16)
        ),
    )
    yield "tp=2", ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, annotations=tp, mixed_precision=policy)
    yield (
        "dp=2 x tp=2 zero=3",
        ap.plan(
            model,
            ap.Mesh((2, 2), ("dp", "tp")),
            kwargs=kw,
            annotations=tp,
            data_parallel=ap.DataParallel("dp", zero=3, param_dtype=BF16, reduce_dtype=torch.float32),
        ),
    )


@pytest.mark.parametrize("which", ["dp=2 zero=3", "dp=2 zero=0", "tp=2", "dp=2 x tp=2 zero=3"])
def test_kept_fp32_against_the_serial_recipe(which):
    """Each plan traces the router's weight in fp32 and equals the serial recipe: loss, every
    fp32 gradient; the router's computed in fp32 alike. Without the kept list the recipe itself
    fails (the router's F.linear reads fp32 activations and a bf16 weight)."""
    model, kw = _model(), _inputs()
    with pytest.raises(RuntimeError, match="dtype"):  # the recipe as FSDP2 writes it, every parameter cast
        low = {n: p.to(BF16) for n, p in model.named_parameters()}
        torch.func.functional_call(model, low, (), kw)
    want_loss, want = _reference(model, kw, BF16)
    plan = dict(_plans(model, kw))[which]
    assert plan.traced.kept_fp32 == {"router.weight"}
    weight = next(n for n in plan.traced.gm.graph.nodes if plan.traced.param_fqn.get(n.name) == "router.weight")
    assert weight.meta["val"].dtype == torch.float32  # traced in fp32; the others in bf16
    got_loss, got, modules = _step(plan, kw)
    assert got_loss == pytest.approx(want_loss, rel=1e-3)
    for name, ref in want.items():
        g = got[name]
        assert g.dtype == torch.float32, name
        assert (g - ref).norm() <= GRAD_REL * ref.norm(), f"{which}: {name} {(g - ref).norm() / ref.norm():.2e}"
    assert all(p.dtype == torch.float32 for m in modules for p in m.parameters())  # fp32 masters


def test_kept_fp32_buckets_and_copies():
    """zero=3 gathers the kept weight in a bucket of its own, in fp32; the bf16 copies a plan
    counts (zero 0-2: ``compute_copies``) leave it out, and zero=3's gathered bytes count it at
    4 bytes per element; plan.cost() and ap.predict's estimate agree with memory_per_rank."""
    model, kw = _model(), _inputs()
    plans = dict(_plans(model, kw))
    z3 = plans["dp=2 zero=3"]
    kept = [b for b in buckets_cached(z3) if b.kept]
    assert [b.names for b in kept] == [["router.weight"]]
    assert kept[0].gather_dtype(BF16) == torch.float32
    assert all(b.gather_dtype(BF16) == BF16 for b in buckets_cached(z3) if not b.kept)
    z0 = plans["dp=2 zero=0"]
    cast = sum(p.numel() for n, p in model.named_parameters() if n != "router.weight")
    assert z0.memory_per_rank(0)["compute_copies"] == cast * 2
    z3_mem = z3.memory_per_rank(0)
    full = [b.chunk * 2 * b.gather_dtype(BF16).itemsize for b in buckets_cached(z3)]
    assert z3_mem["gathered"] in {sum(full[i : i + 2]) for i in range(len(full))}
    for plan in (z0, z3):  # plan.cost() and ap.predict (the search's own estimate) count the same
        mem, cost = plan.memory_per_rank(0), plan.cost(rank=0).at()["memory"]
        assert cost.get("compute_copies", 0) == mem.get("compute_copies", 0)
        assert sum(cost.values()) == pytest.approx(mem.total, rel=1e-9)
        pred = ap.predict(plan, "cpu-gloo")
        assert pred["memory_estimate"] == pytest.approx(pred["memory"], rel=1e-9)


def test_fp16_keeps_the_plain_list_too():
    """Under fp16 HF keeps ``_keep_in_fp32_modules`` as well (the head here): zero=3 traces and
    gathers both kept weights in fp32 and equals the fp16 serial recipe keeping the same two."""
    model, kw = _model(), _inputs()
    dp = ap.DataParallel("dp", zero=3, param_dtype=torch.float16)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), kwargs=kw, data_parallel=dp)
    assert plan.traced.kept_fp32 == {"router.weight", "head.weight"}
    assert sorted(n for b in buckets_cached(plan) if b.kept for n in b.names) == ["head.weight", "router.weight"]
    want_loss, want = _reference(model, kw, torch.float16)
    got_loss, got, _ = _step(plan, kw)
    assert got_loss == pytest.approx(want_loss, rel=1e-3)
    for name, ref in want.items():
        assert (got[name] - ref).norm() <= GRAD_REL * ref.norm(), name
