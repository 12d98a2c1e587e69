"""The benchmarks run (tiny sizes), the propagation cache changes nothing, owned all-reduces are
marked only where safe (the gloo benchmarks: gloo/test_bench.py)."""

from __future__ import annotations

import json

import pytest

import autopar as ap
from autopar.sharding.annotations import resolve
from autopar.sharding.propagate import propagate
from autopar.trace.export import trace
from tests.harness.models import MEGATRON, MLP, MLP_TP, gpt_batch, small_gpt


def _layouts(traced):
    return {n.name: n.meta["autopar"] for n in traced.gm.graph.nodes if "autopar" in n.meta}


def test_propagate_cache_gives_identical_layouts():
    model, (idx, tg) = small_gpt(layers=3), gpt_batch()
    mesh = ap.Mesh((2, 2), ("dp", "tp"))
    traced = trace(model, (idx, tg))
    seeds = resolve(MEGATRON, model, mesh, traced.user_inputs, "dp", {n: 2 for n in traced.user_inputs})
    ctx = propagate(traced, mesh, seeds)
    cached = _layouts(traced)
    assert 0 < len(ctx.choices) < len(cached) / 3  # repeated blocks are solved once
    propagate(traced, mesh, seeds, cache=False)
    assert _layouts(traced) == cached


def test_propagate_cache_kept_across_propagations_is_never_stale():
    """The choice cache lives on the graph (gm.meta) and is shared by every later propagation of
    it, as the search's probes do: under other annotations, another data-parallel axis, a mesh
    of the same shape with a batch cut unevenly, piece multiples, each propagation must give
    what a propagation without the cache gives."""
    model, (idx, tg) = small_gpt(layers=2), gpt_batch()
    traced = trace(model, (idx, tg))
    ndims = {n: 2 for n in traced.user_inputs}
    cases = [
        ((2, 2), ("dp", "tp"), MEGATRON, "dp", {}),
        ((2, 2), ("dp", "tp"), {}, "dp", {}),
        ((2, 2), ("dp", "tp"), MEGATRON, None, {}),
        ((2, 2), ("tp", "dp"), MEGATRON, "dp", {}),
        ((2, 2), ("dp", "tp"), MEGATRON, "dp", {1: 2}),  # context parallel's multiple of pieces
        ((3, 2), ("dp", "tp"), MEGATRON, "dp", {}),  # a batch of 8 cut unevenly on dp=3
        ((3, 2), ("dp", "tp"), MEGATRON, None, {}),
        ((2, 2), ("dp", "tp"), MEGATRON, "dp", {}),  # the first again, after the others
    ]
    for shape, names, annotated, dp, multiple in cases:
        mesh = ap.Mesh(shape, names)
        seeds = resolve(annotated, model, mesh, traced.user_inputs, dp, ndims)
        seeds.piece_multiple.update(multiple)
        propagate(traced, mesh, seeds)
        cached = _layouts(traced)
        propagate(traced, mesh, seeds, cache=False)
        assert _layouts(traced) == cached, (shape, names, dp, multiple)


def test_compile_and_memory_bench_quick(tmp_path):
    from bench import run

    out = tmp_path / "r.json"
    assert run.main(["--quick", "--only", "compile,memory", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if r["metric"] == "FAILED"]
    mem = {(r["case"], r["metric"]): r["value"] for r in rows if r["benchmark"] == "memory"}
    assert mem[("gpt tiny, tp=2", "param MiB per rank")] < mem[("gpt tiny, tp=1", "param MiB per rank")]
    assert any(r["metric"] == "emit 8 ranks / 1 rank" for r in rows)
    assert run.markdown(rows).count("\n") == len(rows) + 1


@pytest.mark.parametrize("quick", [True])
def test_every_bench_module_has_run(quick):
    import importlib
    from bench import run

    for name in run.modules():
        assert callable(importlib.import_module(f"bench.{name}").run)


def test_owned_all_reduce_only_where_nothing_else_reads():
    """Row-parallel outputs (fresh matmul results, one use) are reduced in place on real
    backends; the graph says so with owned=True. Values reused elsewhere are never marked."""
    import torch

    model, x = MLP(), torch.randn(4, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations=MLP_TP)
    reduces = [n for n in plan.module(0).graph.nodes if n.target is torch.ops.autopar.all_reduce.default]
    assert reduces and all(n.kwargs.get("owned") for n in reduces)
    for n in reduces:
        assert len(n.args[0].users) == 1 and "linear" in str(n.args[0].target)
    plan.check(x)


def test_published_eager_rows_are_what_their_sources_ran():
    """Each eager row's published MFU is its WPS at the row's sizes and sequence length under
    torchtitan's count (6 x all parameters + 12 x layers x heads x head_dim x seq FLOPs per token,
    over the bf16 peak its train.py took: A100 312, H100 SXM 989 TFLOP/s): a wrong size or
    sequence length would not reproduce it. The mesh holds the GPUs the source names, and each
    row is predicted under a known profile with the measured ``h100`` beside it."""
    from autopar.search.profiles import PROFILES
    from bench.bench_published import PUBLISHED_EAGER, SIZES, eager_args

    peak = {"a100": 312e12, "h100-500w": 989e12}
    gpus = {"a100": 64, "h100-500w": 128}
    for name, (size, shape, names, local, seq, mode, profile, wps, mfu, source, _) in PUBLISHED_EAGER.items():
        hidden, inter, layers, heads, kv, vocab = (*SIZES[size], 128256) if isinstance(size, str) else size
        hd = hidden // heads
        block = 2 * hidden * hidden + 2 * hidden * kv * hd + 3 * hidden * inter + 2 * hidden
        params = 2 * vocab * hidden + layers * block + hidden
        flops = 6 * params + 12 * layers * heads * hd * seq
        assert abs(100 * flops * wps / peak[profile] - mfu) < 0.15, name
        assert profile in PROFILES and mode in ("none", "selective", "full"), name
        n = 1
        for s in shape:
            n *= s
        assert n == gpus[profile] and len(shape) == len(names), name
        assert "pytorch/torchtitan" in source and "docs/performance.md" in source, name
        args = eager_args(name)
        assert args[-1][0] == profile and "h100" in args[-1] and args[6] is None, name
