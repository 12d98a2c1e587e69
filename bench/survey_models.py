"""Tiny versions of every architecture the installed transformers can build (for bench/survey.py).

Each architecture with a causal-LM, seq2seq-LM, masked-LM or image-classification head is
built from its default config class with every size shrunk (hidden 32, 2 layers, 4 heads,
vocabulary 128, images 32x32), random weights, ``attn_implementation="eager"``.

Example:
    >>> arch = architectures()[0]          # Arch('LlamaForCausalLM', 'llama', 'causal-lm')
    >>> model, kwargs = build(arch)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADS = {  # head kind -> transformers' auto mapping
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
VOCAB, HIDDEN, FFN, LAYERS, HEADS_N, KV_HEADS, IMAGE, BATCH, SEQ = 128, 32, 64, 1, 4, 2, 32, 4, 8

# config field -> tiny value; matched on the exact name in the config and every sub-config
SIZES = {
    **dict.fromkeys(
        [
            "hidden_size",
            "d_model",
            "n_embd",
            "embed_dim",
            "dim",
            "word_embed_proj_dim",
            "embedding_size",
            "text_embed_dim",
            "projection_dim",
            "d_embed",
        ],
        HIDDEN,
    ),
    **dict.fromkeys(
        [
            "intermediate_size",
            "d_ff",
            "ffn_dim",
            "n_inner",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "hidden_dim",
            "ffn_hidden_size",
            "inner_hidden_size",
            "mlp_dim",
        ],
        FFN,
    ),
    **dict.fromkeys(
        ["moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size", "moe_ffn_hidden_size"],
        FFN // 2,
    ),
    **dict.fromkeys(
        [
            "num_hidden_layers",
            "n_layer",
            "num_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "n_layers",
            "num_encoder_layers",
        ],
        LAYERS,
    ),
    **dict.fromkeys(
        ["num_attention_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads", "num_heads", "n_heads"],
        HEADS_N,
    ),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"], KV_HEADS),
    **dict.fromkeys(["head_dim", "kv_channels", "attention_head_size", "d_kv"], HIDDEN // HEADS_N),
    "rotary_dim": HIDDEN // HEADS_N // 2,  # GPT-J, CodeGen: rotary over part of each head
    **dict.fromkeys(["vocab_size", "n_vocab", "decoder_vocab_size"], VOCAB),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"], 64),
    **dict.fromkeys(["num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "top_k"], 2),
    "image_size": IMAGE,
    "window_size": 4,  # Swin family: a window no larger than the 8 x 8 patches of a 32 x 32 image
    # multi-head latent attention (DeepSeek-V2/V3 style): low-rank q/kv and split rope/nope head dims
    **dict.fromkeys(["kv_lora_rank", "q_lora_rank"], 16),
    **dict.fromkeys(["qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"], HIDDEN // HEADS_N),
    **dict.fromkeys(["n_group", "topk_group"], 1),
    # Mamba-2 mixers (Bamba, ...): heads x head dim = expand x hidden
    **dict.fromkeys(["mamba_n_heads", "mamba_d_head"], 8),
    "mamba_d_state": 16,  # expert groups must divide the (4) experts
}
TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "unk_token_id",
)


@dataclass(frozen=True)
class Arch:
    name: str  # the model class, e.g. 'LlamaForCausalLM'
    model_type: str  # the config's model_type, e.g. 'llama'
    head: str  # one of HEADS


def architectures() -> list[Arch]:
    """Every (model class, model type, head) of the installed transformers' auto mappings."""
    from transformers.models.auto import modeling_auto

    found: dict[str, Arch] = {}
    for head, mapping in HEADS.items():
        for model_type, name in getattr(modeling_auto, mapping).items():
            for n in name if isinstance(name, (tuple, list)) else (name,):
                if n not in found or _own_type(n) == model_type:  # a class shared by several types: its own
                    found[n] = Arch(n, model_type, head if n not in found else found[n].head)
    return list(found.values())


def _own_type(name: str) -> str | None:
    import transformers

    try:
        return getattr(transformers, name).config_class.model_type
    except Exception:  # noqa: BLE001 - a class that does not import is reported by build()
        return None


def _sub_configs(cfg):
    """The config and every config nested in it (text_config, vision_config, encoder, ...)."""
    from transformers import PretrainedConfig

    out, todo = [], [cfg]
    while todo:
        c = todo.pop()
        if any(c is o for o in out):
            continue
        out.append(c)
        todo += [v for v in vars(c).values() if isinstance(v, PretrainedConfig)]
    return out


# fields a model type derives other sizes from (EfficientNet's last conv is built from its own
# scaling, not from hidden_dim, but its batch norm reads hidden_dim): left as they are
KEEP = {("efficientnet", "hidden_dim")}


def _shrink(c) -> None:
    fields = vars(c)
    for key, tiny in SIZES.items():
        if (getattr(c, "model_type", ""), key) in KEEP:
            continue
        if isinstance(fields.get(key), int) and not isinstance(fields[key], bool) and fields[key] > tiny:
            setattr(c, key, tiny)
    for key in ("hidden_sizes", "depths", "embed_dims", "num_heads", "ffn_dims", "encoder_hidden_sizes"):
        v = fields.get(key)
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v):
            small = {"depths": 1, "num_heads": 2}.get(key)
            setattr(c, key, [small or min(x, 16 * 2**i) for i, x in enumerate(v)])
    layers = next(
        (fields[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if isinstance(fields.get(k), int)), None
    )
    for key in ("layer_types", "block_types", "attention_layers", "mlp_only_layers"):
        v = fields.get(key)
        if isinstance(v, list) and layers is not None and len(v) > layers and key != "mlp_only_layers":
            setattr(c, key, v[:layers])
    if isinstance(fields.get("qk_rope_head_dim"), int):  # MLA: rotary over the rope part of each head
        if isinstance(fields.get("qk_nope_head_dim"), int):
            fields["qk_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
        if "head_dim" in fields:
            fields["head_dim"] = fields["qk_rope_head_dim"]
        if isinstance(fields.get("num_attention_heads"), int) and "num_key_value_heads" in fields:
            fields["num_key_value_heads"] = fields["num_attention_heads"]  # MLA: one key head per query head
    if (
        all(isinstance(fields.get(k), (int, float)) for k in ("expand", "head_dim", "num_heads", "hidden_size"))
        and "n_groups" in fields
    ):  # Mamba-2: heads x head dim = expand x hidden, groups divide heads
        fields["num_heads"] = int(fields["expand"] * fields["hidden_size"]) // fields["head_dim"]
        fields["n_groups"] = 1
    if isinstance(fields.get("mamba_d_ssm"), int) and isinstance(fields.get("mamba_n_heads"), int):
        fields["mamba_d_ssm"] = fields["mamba_n_heads"] * fields["mamba_d_head"]  # Falcon-H1: the mixer's width
    for key in TOKEN_IDS:
        v = fields.get(key)
        if isinstance(v, int) and v >= VOCAB:
            setattr(c, key, VOCAB - 1 - TOKEN_IDS.index(key))
    for key in ("use_cache", "tie_word_embeddings"):
        if key in fields and key == "use_cache":
            setattr(c, key, False)
    for key in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "dropout",
        "attention_dropout",
        "hidden_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "activation_dropout",
    ):
        if isinstance(fields.get(key), float):
            setattr(c, key, 0.0)


def tiny_config(arch: Arch):
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[arch.model_type]()
    for c in _sub_configs(cfg):
        _shrink(c)
    return cfg


def build(arch: Arch, seed: int = 0):
    """(model in eval mode, example kwargs) for one architecture; raises if it cannot be built."""
    import transformers

    cls = getattr(transformers, arch.name)
    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    try:
        model = cls._from_config(cfg, attn_implementation="eager")
    except (ValueError, TypeError):
        model = cls(cfg)
    kwargs = example_inputs(arch, model)
    with torch.no_grad():  # a model that needs other inputs (audio, a language id) is not surveyed
        try:
            model.eval()(**kwargs)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(
                f"the serial model does not run on the survey's inputs: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            ) from e
    return model.eval(), kwargs


def example_inputs(arch: Arch, model) -> dict:
    g = torch.Generator().manual_seed(1)
    if arch.head == "image-classification":
        cfg = model.config
        vis = getattr(cfg, "vision_config", None) or cfg
        channels = getattr(vis, "num_channels", 3)
        size = getattr(vis, "image_size", IMAGE)
        size = size[0] if isinstance(size, (list, tuple)) else size
        return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=g)}
    vocab = min(_vocab(model), VOCAB)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    kwargs = {"input_ids": ids}
    if arch.head == "seq2seq-lm":
        kwargs["decoder_input_ids"] = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    return kwargs


def _vocab(model) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(emb, "num_embeddings", VOCAB) if emb is not None else VOCAB
