"""Tiny HuggingFace models (random weights, no download) and their Megatron annotations.

>>> plan, kw = hf_plan("llama", "dp2xtp2")   # LLaMA, Megatron + vocab parallel, on dp x tp
>>> plan.check(**kw, rtol=1e-4, atol=1e-5)
"""

from __future__ import annotations

import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks
from tests.harness.meshes import MESHES
from tests.harness.serial import assert_params_close

VOCAB, HIDDEN, SEQ = 128, 32, 8


def llama(layers=1, seed=0, kv_heads=2, attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation=attn,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg).eval()


def gpt2(layers=1, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=layers,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg).eval()


def bert(layers=1, seed=0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation="eager",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertModel(cfg).eval()


def causal_lm(name: str, layers=1, seed=0, attn="eager"):
    """A tiny causal LM of another HF architecture than the ones above (issue 32's user paths):
    gemma2, granite, stablelm, phi3, olmo2; qwen2 (context parallel's tests), llama and mistral
    (the precision policy's); ``attn``: its
    attention implementation ("eager", "sdpa")."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
        use_cache=False,
        tie_word_embeddings=False,
    )
    config, model, extra = {
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, {}),
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(head_dim=8)),
        "granite": (T.GraniteConfig, T.GraniteForCausalLM, {}),
        "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, {}),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(pad_token_id=0)),
        "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
    }[name]
    return model(config(**common, **extra)).eval()


CAUSAL_LMS = ("gemma2", "granite", "stablelm", "phi3", "olmo2")


def batch(b=4, s=SEQ, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g), torch.randint(0, VOCAB, (b, s), generator=g)


def packed_batch(docs=((5, 7, 4), (16,)), seed=1) -> dict:
    """HF keyword inputs for rows of documents packed along the sequence (lengths ``docs`` per
    row): position ids restart at each document, so HF builds a per-document causal mask."""
    ids, labels = batch(b=len(docs), s=sum(docs[0]), seed=seed)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


LLAMA_TP = {
    "model.layers.*.self_attn.[qkv]_proj": ap.colwise("tp"),
    "model.layers.*.self_attn.o_proj": ap.rowwise("tp"),
    "model.layers.*.mlp.gate_proj": ap.colwise("tp"),
    "model.layers.*.mlp.up_proj": ap.colwise("tp"),
    "model.layers.*.mlp.down_proj": ap.rowwise("tp"),
}
GPT2_TP = {
    "transformer.h.*.attn.c_attn": ap.colwise("tp", blocks=3),
    "transformer.h.*.attn.c_proj": ap.rowwise("tp"),
    "transformer.h.*.mlp.c_fc": ap.colwise("tp"),
    "transformer.h.*.mlp.c_proj": ap.rowwise("tp"),
}
BERT_TP = {
    "encoder.layer.*.attention.self.query": ap.colwise("tp"),
    "encoder.layer.*.attention.self.key": ap.colwise("tp"),
    "encoder.layer.*.attention.self.value": ap.colwise("tp"),
    "encoder.layer.*.attention.output.dense": ap.rowwise("tp"),
    "encoder.layer.*.intermediate.dense": ap.colwise("tp"),
    "encoder.layer.*.output.dense": ap.rowwise("tp"),
}

LLAMA_VOCAB = {"model.embed_tokens": ap.vocab_parallel("tp"), "lm_head": ap.vocab_parallel("tp")}
GPT2_VOCAB = {"transformer.wte": ap.vocab_parallel("tp"), "lm_head": ap.vocab_parallel("tp")}
BERT_VOCAB = {"embeddings.word_embeddings": ap.vocab_parallel("tp")}


MODELS = {  # name -> (builder, annotations, needs labels)
    "llama": (llama, {**LLAMA_TP, **LLAMA_VOCAB}, True),
    "gpt2": (gpt2, {**GPT2_TP, **GPT2_VOCAB}, True),
    "bert": (bert, {**BERT_TP, **BERT_VOCAB}, False),
}


def inputs(name, b=4, s=SEQ, seed=1):
    ids, labels = batch(b, s, seed)
    return {"input_ids": ids, "labels": labels} if MODELS[name][2] else {"input_ids": ids}


def hf_plan(name, mesh_name, annotations=None, layers=1, dynamic=False, strict=False, **model_kw):
    build, ann, _ = MODELS[name]
    spec = MESHES[mesh_name]
    model = build(layers=layers, **model_kw)
    kw = inputs(name)
    plan = ap.plan(
        model,
        spec.mesh(),
        kwargs=kw,
        annotations=annotations or ann,
        data_parallel=spec.dp,
        dynamic=dynamic,
        strict=strict,
    )
    return plan, kw


def preset_plans(model, kwargs, annotations):
    """The plan of ``annotations`` (a preset's) on (2,) tp and (2, 2) dp x tp, static shapes."""
    for spec in (MESHES["tp2"], MESHES["dp2xtp2"]):
        yield ap.plan(
            model, spec.mesh(), kwargs=kwargs, annotations=dict(annotations), data_parallel=spec.dp, dynamic=False
        )


def megatron_dp_plan(model, mesh, kwargs):
    """The hand plan the automatic search is measured against: Megatron on axis "b", data
    parallel on axis "a", static shapes."""
    return ap.plan(
        model,
        mesh,
        kwargs=kwargs,
        annotations=ap.presets.megatron(model, "b", kwargs=kwargs),
        data_parallel="a",
        dynamic=False,
    )


ADAMW = dict(lr=0.01, weight_decay=0.1, eps=1e-3)  # eps well above float noise: AdamW divides by sqrt(v)


def adamw_matches_serial(plan, build, batches: list[dict], where: str = "", rtol=1e-4, atol=1e-5) -> None:
    """AdamW steps, one per batch (HF keyword inputs with labels), on every rank of ``plan``
    (simulated) end where the same steps on a fresh serial model from ``build()`` end."""
    serial = build().train()
    opt = torch.optim.AdamW(serial.parameters(), **ADAMW)
    for kw in batches:
        serial(**kw).loss.backward()
        opt.step()
        opt.zero_grad()

    def train(rank):
        module = plan.build_module(rank)
        opt = torch.optim.AdamW(module.parameters(), **ADAMW)
        for kw in batches:
            args, kwargs = plan.local_inputs(rank, **kw)
            module(*args, **kwargs).loss.backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    got = plan.merge_state_dicts(run_ranks(plan.mesh.size, train))
    assert_params_close(got, dict(serial.named_parameters()), where, rtol=rtol, atol=atol)


def meta_llama(layers=2, batch=8, seq=32):
    """A tiny HF LLaMA built on the meta device (sdpa, GQA: 4 heads over 2 kv heads) and its
    meta batch as kwargs, for dry runs: ``model, kw = meta_llama(layers=4)``."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}
