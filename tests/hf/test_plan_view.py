"""The default view of a HuggingFace LLaMA's plan grows with its distinct structure, not its depth
(issue 51): print(plan) and the notebook's HTML, Megatron preset on dp x tp.

``python -m tests.hf.test_plan_view`` prints the figures docs/explore.md quotes.
"""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.explore.html import plan_html


def tiny_llama_plan(layers: int):
    """The llama notebook's model (hidden 64, 4 heads, 2 K/V heads) on dp=2 x tp=2, Megatron preset."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (8, 16))
    kw = {"input_ids": ids, "labels": ids}
    ann = ap.presets.megatron(model, "tp", kwargs=kw)
    return ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), kwargs=kw, annotations=ann, data_parallel="dp")


def llama_8b_plan(layers: int = 32, mesh=(8, 8)):
    """LLaMA-3-8B's shapes on the meta device (nothing allocated), Megatron preset on dp x tp."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=2048,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(mesh[0], 2048, dtype=torch.long, device="meta")
    kw = {"input_ids": ids, "labels": ids}
    ann = ap.presets.megatron(model, "tp", kwargs=kw)
    mesh = ap.Mesh(mesh, ("dp", "tp"))
    return ap.plan(model, mesh, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)


def sizes(plan) -> dict:
    text, html = str(plan), plan_html(plan)
    return {
        "text lines": len(text.splitlines()),
        "text chars": len(text),
        "html rows": html.count('class="g'),  # module lines and op rows, open or behind a click
        "flat table lines": len(plan.table().splitlines()),
    }


def test_tiny_llama_view_is_the_same_size_at_2_and_16_layers():
    two, sixteen = tiny_llama_plan(2), tiny_llama_plan(16)
    a, b = sizes(two), sizes(sixteen)
    assert b["text chars"] <= 1.5 * a["text chars"] and b["text lines"] == a["text lines"], (a, b)
    assert b["html rows"] <= 1.5 * a["html rows"]
    assert b["flat table lines"] > 4 * a["flat table lines"]  # what the view used to be
    text = str(sixteen)
    assert "layers.0-15 x 16, identical plan" in text and text.count("· ") < 15
    assert "q_proj" in text and "weight (R, S(0))" in text and "o_proj" in text and "weight (R, S(1))" in text


@pytest.mark.slow  # 10 s here; the tiny LLaMA above takes the same path
def test_llama_8b_on_64_ranks_fits_one_screen():
    plan = llama_8b_plan()
    s = sizes(plan)
    assert s["text lines"] <= 50 and s["html rows"] <= 250, s  # 50 of them gradient buckets, behind a click
    assert "layers.0-31 x 32, identical plan" in str(plan)


if __name__ == "__main__":
    for name, build in (
        ("tiny LLaMA, 2 layers", lambda: tiny_llama_plan(2)),
        ("16 layers", lambda: tiny_llama_plan(16)),
    ):
        print(name, sizes(build()))
    for layers in (2, 32):
        print(f"LLaMA-8B shapes, {layers} layers, (8, 8)", sizes(llama_8b_plan(layers)))
