"""Plans shared by the plan-exploring tests: built once per test session."""
from __future__ import annotations

from functools import lru_cache

import autopar as ap
from tests.models import MEGATRON, gpt_batch, small_gpt


@lru_cache(maxsize=None)
def gpt_plan(shape=(2, 2), annotated=True):
    """The small GPT (8x8 batch) with the Megatron annotations on dp x tp (or tp only)."""
    axes = ("dp", "tp")[-len(shape):]
    model = small_gpt()
    return ap.plan(model, ap.Mesh(shape, axes), args=gpt_batch(batch=8, seq=8),
                   annotations=MEGATRON if annotated else None,
                   data_parallel="dp" if "dp" in axes else None)
