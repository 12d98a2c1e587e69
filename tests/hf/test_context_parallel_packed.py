"""Packed sequences under context parallel: documents packed along the sequence, position ids
restarting at each document (HF's packed-sequence path: with ``position_ids`` and no attention
mask HF builds a per-document causal mask, as FlashAttention's varlen attends). Ring, all-gather
and Ulysses equal serial (outputs, every gradient, 3 AdamW steps) on tiny HF LLaMA and Qwen2,
load balanced or not; the ring and all-gather skip key blocks of other documents."""

from __future__ import annotations

import pytest
import autopar as ap
import autopar.parallel.context.block_attention as context_attention
from autopar.parallel.context.ulysses import gather_mask_rows, ulysses_attention
from tests.harness.hf_models import adamw_matches_serial, causal_lm, llama
from tests.harness.hf_models import packed_batch as packed

import transformers  # noqa: F401  (pinned: a missing one is a failure, not a skip)

BUILD = {
    "llama": lambda: llama(layers=2, attn="sdpa"),
    "qwen2": lambda: causal_lm("qwen2", layers=2, attn="sdpa"),
}


def _plan(name, n, method, balanced, kw):
    cp = ap.ContextParallel("cp", method=method, load_balance=balanced)
    return ap.plan(BUILD[name](), ap.Mesh((n,), ("cp",)), kwargs=kw, context_parallel=cp)


def test_documents_change_the_serial_result():
    """The packed inputs are not the unpacked ones: each document attends only to itself."""
    model, kw = BUILD["llama"](), packed()
    assert (model(**kw).logits - model(input_ids=kw["input_ids"]).logits).abs().max() > 1e-3


@pytest.mark.parametrize(
    "name, n, method, balanced",
    [
        ("llama", 2, "ring", False),
        ("llama", 4, "ring", True),
        ("qwen2", 4, "allgather", True),
        ("llama", 2, "ulysses", False),
        ("qwen2", 4, "ulysses", True),
    ],
)
def test_packed_documents_match_serial(name, n, method, balanced):
    kw = packed()
    plan = _plan(name, n, method, balanced, kw)
    assert len(plan.built["context_parallel"]) == 2
    plan.check(**kw, loss=lambda out: out.loss)
    adamw_matches_serial(plan, BUILD[name], [packed(seed=s) for s in (1, 2, 3)], where=f"packed {method}")


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_blocks_of_other_documents_are_skipped(method, monkeypatch):
    """Two documents of 8 on cp=2: rank 1's queries (the second document) meet rank 0's keys (the
    first) nowhere, so each rank computes its own block only: 2 blocks per call, not 3."""
    kw = packed(docs=((8, 8), (8, 8)))
    plan = _plan("llama", 2, method, False, kw)
    calls = []
    real = context_attention._block_forward
    monkeypatch.setattr(context_attention, "_block_forward", lambda *a: calls.append(1) or real(*a))
    plan.check(**kw, loss=lambda out: out.loss)
    assert len(calls) == 2 * 2  # 2 attention calls x 1 block on each of 2 ranks


def test_ulysses_runs_masked_attention_in_key_blocks(monkeypatch):
    """Under a model's mask Ulysses attends every position in key blocks (context/ulysses.MASK_BLOCK,
    4 keys here: 4 blocks of the 16, each block's additive mask (16 x 4), not (16 x 16)); it equals
    serial. Every block meets some query of its own document, so none is skipped."""
    import autopar.parallel.context.ulysses as ulysses

    monkeypatch.setattr(ulysses, "MASK_BLOCK", 4)
    kw = packed(docs=((8, 8), (8, 8)))
    plan = _plan("llama", 2, "ulysses", True, kw)
    calls = []
    real = context_attention._block_forward
    monkeypatch.setattr(context_attention, "_block_forward", lambda *a: calls.append(1) or real(*a))
    plan.check(**kw, loss=lambda out: out.loss)
    assert len(calls) == 2 * 2 * 4  # 2 attention calls x 2 ranks x 4 key blocks


def test_ulysses_gathers_the_document_mask_once_per_program():
    """Every layer reads the model's one mask: Ulysses gathers its rows once per rank and step (the
    first call's), not once per layer, and the plan counts the same (its bytes are what ran)."""
    kw = packed(docs=((8, 8), (8, 8)))
    plan = _plan("llama", 2, "ulysses", True, kw)
    program = plan.module(0).graph
    assert sum(n.target is gather_mask_rows for n in program.nodes) == 1
    assert sum(n.target is ulysses_attention for n in program.nodes) == 2
    planned = [c for c in plan.collectives() if c.kind == "all_gather" and "attn" in c.module]
    assert len(planned) == 1
    with ap.comm_stats() as stats:
        plan.simulate(lambda m, **local: m(**local).loss.backward(), **kw)
    piece = 2 * 8 * 16  # the rank's (2, 1, 8, 16) rows of the boolean mask, uint8 on the wire
    ran = [r for r in stats.records if r.kind == "all_gather" and (r.numel, r.itemsize) == (piece, 1)]
    assert len(ran) == 1  # not one per layer
    assert ran[0].bytes == pytest.approx(planned[0].bytes) == piece  # (cp - 1) x the piece
