"""The roofline per op (cost/op_time.py) and the H100 profiles' rates from the stored measurement."""

from __future__ import annotations

import json
import os

import pytest
import torch

import autopar as ap
from autopar.cost.formulas import Numbers
from autopar.cost.op_time import node_bytes, node_seconds, optimizer_step_bytes, roofline
from autopar.search.evaluate import Terms

CALIBRATION = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_calibration_h100.json")


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1024, dtype=torch.bfloat16))

    def forward(self, x):
        return (x * self.w).sum()


def _node(plan, target):
    return next(n for n in plan.graph.nodes if n.target is target)


def test_roofline_takes_the_longer_of_flops_and_bytes():
    assert roofline(1e3, 1e9, 1e12, 1e12) == pytest.approx(1e-3)  # bytes-bound
    assert roofline(1e12, 1.0, 1e12, 1e12) == pytest.approx(1.0)  # FLOP-bound
    assert roofline(1e3, 1e9, 1e12) == pytest.approx(1e-9)  # no bandwidth: FLOPs only


def test_a_memory_bound_op_takes_its_kernels_bytes_over_the_bandwidth():
    """x * w with x (64, 1024) bf16 needing no gradient and w a (1024,) parameter: forward reads x
    and w and writes the product; backward runs dw = sum(dy * x): a product (two reads, a write)
    and a reduction (a read, a (1024,) write)."""
    plan = ap.plan(Scale(), ap.Mesh((1,), ("dp",)), args=(torch.randn(64, 1024, dtype=torch.bfloat16),))
    mul, big, small = _node(plan, torch.ops.aten.mul.Tensor), 64 * 1024 * 2, 1024 * 2
    fwd, bwd = node_bytes(mul, Numbers(plan.mesh), plan.ctx.needs_grad)
    assert fwd == 2 * big + small and bwd == 3 * big + (big + small)
    f, b = node_seconds(mul, Numbers(plan.mesh), 1e15, 2e12, grad=True, needs_grad=plan.ctx.needs_grad)
    assert f == pytest.approx(fwd / 2e12) and b == pytest.approx(bwd / 2e12)
    f, b = node_seconds(mul, Numbers(plan.mesh), 1e9, None, grad=True)  # without a bandwidth: FLOPs
    assert f == pytest.approx(64 * 1024 / 1e9) and b == pytest.approx(2 * f)


def test_optimizer_step_moves_its_state_and_parameters_once():
    """2 x states + 3 x gradients (parameters read and written, gradients read), ZeRO's share."""
    assert optimizer_step_bytes(8.0, 2.0) == 22.0
    prof = ap.Auto(device="h100").profile()
    mesh = ap.Mesh((4,), ("dp",))
    t = Terms(opt_dp=8e9, dp_grad=2e9)
    zero3 = ap.DataParallel("dp", zero=3)
    assert t.step_seconds(mesh, prof, 0, zero3) == pytest.approx(22e9 / 4 / prof.memory_bandwidth)
    assert t.step_seconds(mesh, prof, 0, ap.DataParallel("dp")) == pytest.approx(22e9 / prof.memory_bandwidth)
    assert t.step_seconds(mesh, ap.Auto(device="cpu-gloo").profile(), 0, zero3) == 0.0  # no bandwidth: none


def _measured_rates(path) -> tuple:
    """(matmul FLOP/s, attention FLOP/s, copy B/s) of a bench/gpu_calibration_*.json: the 8B
    layer's four matmuls and its causal flash attention, FLOPs as op_time counts them."""
    with open(path) as f:
        cal = json.load(f)
    flops = seconds = 0.0
    for mm in cal["matmul"][:4]:  # qkv, o, gate_up, down at 2 x 8192 tokens
        one = 2 * mm["m"] * mm["k"] * mm["n"]
        flops += 3 * one
        seconds += one / (mm["fwd_tflops"] * 1e12) + 2 * one / (mm["bwd_tflops"] * 1e12)
    attn = 4 * 2 * 32 * 8192 * 8192 * 128 / 2  # causal QK^T and PV, batch 2, 32 heads, d 128
    measured = 3.5 * attn / (cal["attention"]["fwd_bwd_tflops"] * 1e12)  # the calibration's count
    return flops / seconds, 3 * attn / measured, cal["copy"]["tb_per_s"] * 1e12


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_gpu_rates_are_the_stored_measurement(name):
    """h100's and h200's matmul and attention rates and bandwidth (the copy's) recomputed from
    their bench/gpu_calibration_*.json."""
    matmul, attention, copy = _measured_rates(CALIBRATION.replace("h100", name))
    prof = ap.Auto(device=name).profile()
    assert prof.flops_per_s == pytest.approx(matmul, rel=1e-3)
    assert prof.attention_flops_per_s == pytest.approx(attention, rel=1e-3)
    assert prof.memory_bandwidth == pytest.approx(copy, rel=2e-3)


def test_derived_profiles_take_the_h100_measurement_at_datasheet_ratios():
    """h100-500w: the H100's rates times the datasheets' power-cap ratio, its HBM2e's 2.4 TB/s at
    the share of the datasheet the H100's copy reached; a100 likewise from its datasheet."""
    h100, capped, a100 = (ap.Auto(device=d).profile() for d in ("h100", "h100-500w", "a100"))
    share = h100.memory_bandwidth / 3.35e12
    assert 0.85 < share < 0.95
    assert capped.flops_per_s == pytest.approx(h100.flops_per_s * 886.3 / 989, rel=1e-3)
    assert capped.memory_bandwidth == pytest.approx(2.4e12 * share)
    assert a100.memory_bandwidth == pytest.approx(2.039e12 * share)
    assert a100.flops_per_s == pytest.approx(h100.flops_per_s * 312 / 989)
    assert ap.Auto(device="h100", flops_per_s=1e6).profile().attention_flops_per_s is None


def test_the_measured_layer_against_its_roofline():
    """bench/gpu_calibration.py's LLaMA-3.1-8B layer traced at its measured size (2 x 8192, bf16):
    predicted under h100, its matmuls and attention take the 36.6 ms measured (the rates come from
    them); its memory-bound ops, their kernels' bytes at the 3.0 TB/s the copy reached, take 8.5 ms
    of the 12.4 ms the rest measured (69%: eager kernels of norms and fp32 products run below a
    copy's bandwidth); the layer 45.1 of 49.0 ms."""
    from bench.gpu_calibration import DecoderLayer

    with open(CALIBRATION) as f:
        measured = json.load(f)["layers"][0]["step_ms_per_layer"] / 1e3
    with torch.device("meta"):
        layer = DecoderLayer().to(torch.bfloat16)
    x = torch.empty(2, 8192, 4096, dtype=torch.bfloat16, device="meta", requires_grad=True)  # as in the stack
    table = torch.empty(8192, 128, dtype=torch.bfloat16, device="meta")
    plan = ap.plan(layer, ap.Mesh((1,), ("dp",)), args=(x, table, table), dynamic=False)
    prof, sy = ap.Auto(device="h100").profile(), Numbers(plan.mesh)
    tensor = memory = 0.0
    for node in plan.graph.nodes:
        if node.op != "call_function" or not plan.ctx.needs_grad.get(node):
            continue
        grads, attn = plan.ctx.needs_grad, prof.attention_flops_per_s
        f, b = node_seconds(node, sy, prof.flops_per_s, prof.memory_bandwidth, True, grads, attn)
        kind = ap.cost.op_time.op_work(node).kind
        if kind in ("matmul", "attention"):
            tensor += f + b
        else:
            memory += f + b
    assert tensor == pytest.approx(0.747 * measured, rel=0.01)
    assert 0.65 < memory / (measured - tensor) < 0.73
    assert 0.9 < (tensor + memory) / measured < 0.96


def test_plan_cost_time_is_the_predicted_compute():
    """plan.cost().time(..., bandwidth=) gives each op's roofline and the optimizer step as
    ap.predict does (the same profile's numbers; zero=1: each rank steps half the state)."""
    from tests.harness.models import gpt_batch, small_gpt

    zero1 = ap.DataParallel("dp", zero=1)
    plan = ap.plan(small_gpt(), ap.Mesh((2,), ("dp",)), args=gpt_batch(), data_parallel=zero1)
    prof = ap.Auto(device="h100").profile()
    cost, pred = plan.cost(), ap.predict(plan, prof)
    t = cost.time(0.0, 1e30, prof.flops_per_s, prof.memory_bandwidth, prof.attention_flops_per_s)
    assert cost.sy.value(t["compute"]) == pytest.approx(pred["compute_s"], rel=1e-6)
    assert cost.sy.value(t["optimizer"]) == pytest.approx(pred["optimizer_s"], rel=1e-6)
    assert pred["optimizer_s"] > 0 and pred["compute_s"] > cost.sy.value(cost.flops) / prof.flops_per_s


@pytest.mark.parametrize(
    "name, profile",
    [("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100")],
)
def test_a_cuda_job_is_planned_for_its_cards_profile(monkeypatch, name, profile):
    """The default profile follows the card's name (no GPU needed: the name is what is read)."""
    from autopar.search.profiles import profile_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda where=None: name)
    assert profile_for(torch.device("cuda", 0)) == profile
