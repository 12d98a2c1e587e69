"""The LLaMA-3.1 models the published-run benches plan on meta: HF's LlamaForCausalLM at a size,
with torchtitan's attention, and the program that returns the loss alone.

torchtitan's attention is ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` with no mask
tensor. HF's own "sdpa" builds a (B, 1, S, S) boolean mask when traced (it cannot see that no
padding comes); under a name HF has no mask function for (``causal_sdpa``), it builds none and SDPA
runs causal, GQA in the kernel instead of copied K/V heads.

Example:
    >>> cfg = llama_config(4096, 14336, 32, 32, 8, 128256, seq=8192)
    >>> with torch.device("meta"):
    ...     model = LossOnly(LlamaForCausalLM(cfg))
"""

import torch
from transformers import AttentionInterface, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def llama_config(hidden, inter, layers, heads, kv, vocab, seq, causal_sdpa=True) -> LlamaConfig:
    """HF's LlamaConfig at these sizes, no KV cache, untied; ``causal_sdpa``: torchtitan's attention
    (registered with HF here), else HF's default with its traced mask."""
    AttentionInterface.register("causal_sdpa", sdpa_attention_forward)
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
        tie_word_embeddings=False,
        **({"attn_implementation": "causal_sdpa"} if causal_sdpa else {}),
    )


class LossOnly(torch.nn.Module):
    """The step's program returns the loss alone: torchtitan's loop keeps the loss and frees the
    logits (del pred; under a pipeline the last stage feeds them to the loss), where HF's model also
    returns them, gathered over a vocabulary split."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss
