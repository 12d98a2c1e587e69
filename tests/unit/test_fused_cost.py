"""ap.Auto(compiled=, float8=): fused memory-bound regions (cost/fusion.py) and Float8 Linears
(parallel/float8/cost.py) in the cost model that ap.predict and the search share."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autopar as ap
from autopar.cost.execution import op_seconds
from autopar.cost.formulas import Numbers
from autopar.cost.fusion import fused_bytes, fused_regions
from autopar.cost.op_time import node_bytes
from autopar.parallel import TECHNIQUES
from autopar.parallel.float8.cost import cast_bytes, float8_linears
from autopar.search.evaluate import Terms
from autopar.search.profiles import PROFILES
from tests.harness.llama_like import llama_batch, llama_like


@pytest.fixture(scope="module")
def plan():
    ids, labels = llama_batch(batch=2, seq=16)
    return ap.plan(llama_like(d=32, layers=2), ap.Mesh((1,), ("dp",)), kwargs={"input_ids": ids, "labels": labels})


def test_compiled_moves_fewer_memory_bound_bytes_than_eager(plan):
    sy = Numbers(plan.mesh)
    fused = fused_bytes(plan, sy)
    eager = sum(sum(node_bytes(n, sy, plan.ctx.needs_grad)) for n in plan.graph.nodes if n.name in fused)
    assert sum(sum(b) for b in fused.values()) < 0.5 * eager


def test_a_fused_rmsnorm_reads_its_input_once_and_writes_its_output_once(plan):
    """Block 0's first norm, weight * x * rsqrt(mean(x^2) + eps) on x (2, 16, 32) fp32: one
    kernel reading x (4,096 B) and the weight (128 B), writing the output (4,096 B); its backward
    reads the output's gradient, x and the weight again (rsqrt is recomputed from x, not kept)
    and writes x's and the weight's gradients. Eager, five kernels move several times that."""
    norm = next(r for r in fused_regions(plan) if any(n.target is torch.ops.aten.rsqrt.default for n in r))
    assert all("blocks.0.norm1" in str(n.meta.get("nn_module_stack")) for n in norm)
    fused = fused_bytes(plan, Numbers(plan.mesh))
    x, w = 2 * 16 * 32 * 4, 32 * 4
    assert sum(fused[n.name][0] for n in norm) == x + w + x
    assert sum(fused[n.name][1] for n in norm) == x + x + w + x + w
    eager = sum(sum(node_bytes(n, Numbers(plan.mesh), plan.ctx.needs_grad)) for n in norm)
    assert eager > 3 * (x + w + x + x + x + w + x + w)


def test_regions_stop_at_matmuls_and_at_block_boundaries(plan):
    for region in fused_regions(plan):
        assert all(n.target is not torch.ops.aten.linear.default for n in region)
        blocks = {
            p
            for n in region
            for p, _ in (n.meta.get("nn_module_stack") or {}).values()
            if p.rsplit(".", 1)[-1].isdigit()
        }
        assert len(blocks) <= 1


def test_float8_halves_the_linear_matmuls_and_adds_their_casts(plan):
    """Every Linear but the LM head; at a FLOP-bound rate their matmuls take half the time, and
    the casts (5 bytes per element cast: amax read + cast read and fp8 write) come on top."""
    linears = float8_linears(plan)
    assert len(linears) == 14 and all("lm_head" not in p for p in linears.values())
    bf16 = replace(PROFILES["h100"], flops_per_s=1e9, attention_flops_per_s=1e9)
    fp8 = replace(bf16, float8=True)
    sy = Numbers(plan.mesh)
    before = {n: (f, b) for n, f, b, _ in op_seconds(plan, sy, bf16, TECHNIQUES.values())}
    after = {n: (f, b) for n, f, b, _ in op_seconds(plan, sy, fp8, TECHNIQUES.values())}
    casts = cast_bytes(plan, sy, compiled=False)
    q = next(n for n, p in linears.items() if p == "blocks.0.attn.q_proj.weight")
    x_e, w_e, y_e = 2 * 16 * 32, 32 * 32, 2 * 16 * 32
    assert casts[q] == (5 * x_e + 5 * w_e, 5 * y_e + 2 * (w_e + y_e + x_e))
    bw = bf16.memory_bandwidth
    for name in linears:
        assert after[name][0] == pytest.approx(before[name][0] / 2 + casts[name][0] / bw)
        assert after[name][1] == pytest.approx(before[name][1] / 2 + casts[name][1] / bw)
    head = next(n.name for n in plan.graph.nodes if "lm_head" in str(n.meta.get("nn_module_stack")))
    assert after[head] == before[head]


def test_compiled_float8_casts_a_shared_input_once(plan):
    """q, k and v read the same normed input: compiled, one cast of it (AOTAutograd's CSE)."""
    sy = Numbers(plan.mesh)
    eager, compiled = cast_bytes(plan, sy, compiled=False), cast_bytes(plan, sy, compiled=True)
    k = next(n for n, p in float8_linears(plan).items() if p == "blocks.0.attn.k_proj.weight")
    assert compiled[k][0] == eager[k][0] - 5 * 2 * 16 * 32


@pytest.mark.parametrize("device", ["a100", "cpu-gloo"])
def test_float8_is_refused_without_fp8_tensor_cores(plan, device):
    with pytest.raises(ap.PlanError, match=device):
        ap.predict(plan, ap.Auto(device=device, float8=True))
    ap.predict(plan, ap.Auto(device=device, compiled=True))  # compile is fine anywhere


def test_predict_takes_compiled_and_float8_and_keeps_the_plain_call(plan):
    plain = ap.predict(plan, "h100")["time_s"]
    assert plain == ap.predict(plan, ap.Auto(device="h100"))["time_s"]
    assert ap.predict(plan, ap.Auto(device="h100", compiled=True))["time_s"] < plain


def test_fsdp_gathers_float8_weights_in_fp8():
    mesh, prof = ap.Mesh((8,), ("dp",)), PROFILES["h100"]
    zero3 = ap.DataParallel("dp", zero=3)
    bf16 = Terms(dp_grad=8e9, compute=100.0)
    fp8 = Terms(dp_grad=8e9, dp_fp8=6e9, compute=100.0)
    # fp32 masters: gathered in fp32 without a param_dtype (the fp8 weights at 1 of their 4 bytes),
    # in bf16 with one (at 1 of 2)
    for dp, fp8_part in ((zero3, 6e9 / 4), (ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16), 6e9 / 2)):
        _, gathers_bf16, _ = bf16.dp_sync(mesh, prof, 0, dp)
        _, gathers_fp8, _ = fp8.dp_sync(mesh, prof, 0, dp)
        # (the launches' latency, the same in both, is not scaled: 0.2% of the fp32 case)
        assert gathers_fp8 == pytest.approx(gathers_bf16 * (8e9 - 6e9 + fp8_part) / 8e9, rel=5e-3)
    assert fp8.dp_sync(mesh, prof, 0, ap.DataParallel("dp", zero=2)) == bf16.dp_sync(
        mesh, prof, 0, ap.DataParallel("dp", zero=2)
    )


def test_the_search_honours_compiled_and_float8():
    ids, labels = llama_batch(batch=4, seq=16)
    auto = ap.Auto(device="h100", compiled=True, float8=True, pipeline=False)
    plan = ap.plan(
        llama_like(d=32, layers=2), ap.Mesh((2, 2), ("a", "b")), kwargs={"input_ids": ids, "labels": labels}, auto=auto
    )
    assert plan.built["auto"]["time_s"] == pytest.approx(ap.predict(plan, auto)["time_s"], rel=1e-6)


def test_compiling_the_blocks_alone_leaves_the_head_and_loss_eager(plan):
    """torchtitan compiles each TransformerBlock (apply_compile): the final norm, head and loss
    run eager. compiled="blocks" fuses inside the blocks only."""
    sy = Numbers(plan.mesh)
    whole, blocks = fused_bytes(plan, sy), fused_bytes(plan, sy, blocks_only=True)
    assert set(blocks) < set(whole)
    assert all("blocks." in str(n.meta.get("nn_module_stack")) for n in plan.graph.nodes if n.name in blocks)
    t = {c: ap.predict(plan, ap.Auto(device="h100", compiled=c))["time_s"] for c in (False, "blocks", True)}
    assert t[False] > t["blocks"] > t[True]
    with pytest.raises(ap.PlanError, match="compiled"):
        ap.Auto(device="h100", compiled="yes").profile()


def test_fp8_ratio_is_the_datasheets():
    assert PROFILES["h100"].fp8_ratio == pytest.approx(1979 / 989.5)
    assert PROFILES["a100"].fp8_ratio is None and PROFILES["cpu-gloo"].fp8_ratio is None
