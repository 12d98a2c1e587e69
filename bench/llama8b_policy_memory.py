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
from transformers import LlamaForCausalLM

import autopar as ap
from bench.llama_shapes import LossOnly, llama_config

GIB = 2**30


def predict(variant: str) -> dict:
    """ap.predict's memory (GiB) and memory_per_rank's parts of the 8B under ``variant``."""
    opts = set(variant.split("+"))
    cfg = llama_config(4096, 14336, 32, 32, 8, 128256, seq=8192, causal_sdpa="causal" in opts)
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
