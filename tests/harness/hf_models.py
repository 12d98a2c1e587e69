"""Tiny HuggingFace models (random weights, no download) and their Megatron annotations."""
from __future__ import annotations

from collections import Counter

import torch

import autopar as ap

VOCAB, HIDDEN, SEQ = 128, 32, 8


def llama(layers=1, seed=0, kv_heads=2, attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      attn_implementation=attn, tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg).eval()


def gpt2(layers=1, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                     attn_implementation="eager", use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def bert(layers=1, seed=0):
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, attn_implementation="eager",
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(cfg).eval()


def batch(b=4, s=SEQ, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g), torch.randint(0, VOCAB, (b, s), generator=g)


LLAMA_TP = {"model.layers.*.self_attn.[qkv]_proj": ap.colwise("tp"), "model.layers.*.self_attn.o_proj": ap.rowwise("tp"),
            "model.layers.*.mlp.gate_proj": ap.colwise("tp"), "model.layers.*.mlp.up_proj": ap.colwise("tp"),
            "model.layers.*.mlp.down_proj": ap.rowwise("tp")}
GPT2_TP = {"transformer.h.*.attn.c_attn": ap.colwise("tp", blocks=3), "transformer.h.*.attn.c_proj": ap.rowwise("tp"),
           "transformer.h.*.mlp.c_fc": ap.colwise("tp"), "transformer.h.*.mlp.c_proj": ap.rowwise("tp")}
BERT_TP = {"encoder.layer.*.attention.self.query": ap.colwise("tp"), "encoder.layer.*.attention.self.key": ap.colwise("tp"),
           "encoder.layer.*.attention.self.value": ap.colwise("tp"),
           "encoder.layer.*.attention.output.dense": ap.rowwise("tp"),
           "encoder.layer.*.intermediate.dense": ap.colwise("tp"), "encoder.layer.*.output.dense": ap.rowwise("tp")}

LLAMA_VOCAB = {"model.embed_tokens": ap.vocab_parallel("tp"), "lm_head": ap.vocab_parallel("tp")}
GPT2_VOCAB = {"transformer.wte": ap.vocab_parallel("tp"), "lm_head": ap.vocab_parallel("tp")}
BERT_VOCAB = {"embeddings.word_embeddings": ap.vocab_parallel("tp")}


MODELS = {  # name -> (builder, annotations, needs labels)
    "llama": (llama, {**LLAMA_TP, **LLAMA_VOCAB}, True),
    "gpt2": (gpt2, {**GPT2_TP, **GPT2_VOCAB}, True),
    "bert": (bert, {**BERT_TP, **BERT_VOCAB}, False),
}
MESHES = {"tp2": ((2,), ("tp",), None), "tp4": ((4,), ("tp",), None), "dp2xtp2": ((2, 2), ("dp", "tp"), "dp")}


def inputs(name, b=4, s=SEQ, seed=1):
    ids, labels = batch(b, s, seed)
    return {"input_ids": ids, "labels": labels} if MODELS[name][2] else {"input_ids": ids}


def hf_plan(name, mesh_name, annotations=None, layers=1, dynamic=False, strict=False, **model_kw):
    build, ann, _ = MODELS[name]
    shape, axes, dp = MESHES[mesh_name]
    model = build(layers=layers, **model_kw)
    kw = inputs(name)
    plan = ap.plan(model, ap.Mesh(shape, axes), kwargs=kw, annotations=annotations or ann,
                   data_parallel=dp, dynamic=dynamic, strict=strict)
    return plan, kw


def runtime_matches_static(plan, kw):
    """ap.comm_stats over one simulated step (forward, loss backward) equals Plan.collectives on every rank."""
    def step(module, **k):
        module(**k)["loss"].backward()
    with ap.comm_stats() as stats:
        plan.simulate(step, **kw)
    static = Counter((c.kind, c.axis, round(c.bytes, 3)) for c in plan.collectives())
    for rank in plan.mesh.ranks():
        ran = Counter((r.kind, _axis(plan, r.group), round(r.bytes, 3)) for r in stats.for_rank(rank))
        assert ran == static, f"rank {rank}: ran {ran - static} more, {static - ran} fewer than planned"


def _axis(plan, group):
    return next(plan.mesh.axis_names[a] for a in range(plan.mesh.ndim) if group in map(tuple, plan.mesh.groups(a)))
