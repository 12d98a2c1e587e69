"""docs/auto.md's "The fp32 HF model under the policy": ap.predict's memory per rank of LLaMA-3.1-8B
(meta device, 8 ranks, zero=3, selective checkpointing, local batch 2 x 8192) as a user first
writes it, and each step from there to bench_published.py's plan, one change at a time.

A variant is a ``+``-joined list of changes: ``causal`` (attention without a traced mask tensor:
torchtitan's ``is_causal=True``), ``lossonly`` (the program returns the loss alone), ``every2``
(torchtitan's selective policy: every second matmul kept), ``reduce32`` (gradients reduced in fp32),
``static`` (``dynamic=False``), ``bf16model`` (the model converted to bf16, no policy: the bench
before issue 41). ``user``: none of them.

Example:
    $ PYTHONPATH=. python bench/llama8b_policy_memory.py user
    $ PYTHONPATH=. python bench/llama8b_policy_memory.py lossonly+causal+every2+reduce32+static
"""

import json
import sys
import time

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import autopar as ap

GIB = 2**30


class LossOnly(torch.nn.Module):
    """The step's program returns the loss alone (bench_published.py's: the loop frees the logits)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


def predict(variant: str) -> dict:
    """ap.predict's memory (GiB) and memory_per_rank's parts of the 8B under ``variant``."""
    opts = set(variant.split("+"))
    AttentionInterface.register("causal_sdpa", sdpa_attention_forward)  # no mask function: SDPA is_causal
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        use_cache=False,
        tie_word_embeddings=False,
        **({"attn_implementation": "causal_sdpa"} if "causal" in opts else {}),
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16) if "bf16model" in opts else model
        model = LossOnly(model) if "lossonly" in opts else model
    ids = torch.zeros(16, 8192, dtype=torch.long, device="meta")
    dp = ap.DataParallel(
        "dp",
        zero=3,
        **({} if "bf16model" in opts else {"param_dtype": torch.bfloat16}),
        **({"reduce_dtype": torch.float32} if "reduce32" in opts else {}),
    )
    ac = ap.ActivationCheckpoint("selective", save_every=2 if "every2" in opts else 1)
    t0 = time.time()
    plan = ap.plan(
        model,
        ap.Mesh((8,), ("dp",)),
        kwargs={"input_ids": ids, "labels": ids},
        data_parallel=dp,
        activation_checkpoint=ac,
        **({"dynamic": False} if "static" in opts else {}),
    )
    p = ap.predict(plan, "h100")
    mem = plan.memory_per_rank(p["memory_rank"])
    return {
        "variant": variant,
        "GiB": round(p["memory"] / GIB, 2),
        "parts": {k: round(v / GIB, 2) for k, v in mem.items()},
        "estimate_GiB": round(p["memory_estimate"] / GIB, 2),
        "seconds": round(time.time() - t0),
    }


if __name__ == "__main__":
    for v in sys.argv[1:] or ["user"]:
        print(json.dumps(predict(v)), flush=True)
