"""Issue 41's bad input: a precision policy whose dtype the model cannot run in on the plan's device
(an op without a kernel for it) is a PlanError while planning, naming the op (node and module) and
what to write; nothing is left half-planned. On CPU in torch 2.13 neither bfloat16 nor float16 has
LAPACK's decompositions (found here by running each op once on the device) nor the FFTs (export's
own meta functions refuse those; the error names the module and the line)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import autopar as ap

BF16 = torch.bfloat16


class Mix(nn.Module):
    """Mixes the features with a decomposition or a transform the policy's dtype may lack."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "qr":  # passes export; "geqrf_cpu" not implemented for 'BFloat16'
            return torch.linalg.qr(x)[0]
        if self.how == "fft":  # export's meta function refuses: "Unsupported dtype BFloat16"
            return torch.fft.fft(x, dim=-1).real
        if self.how == "qr_fp32":  # the fix the error names: the op kept in fp32 by the model's code
            return torch.linalg.qr(x.float())[0].to(x.dtype)
        return torch.fft.fft(x.float(), dim=-1).real.to(x.dtype)


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc1, self.mix, self.fc2 = nn.Linear(8, 16), Mix(how), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc2(self.mix(self.fc1(x).view(x.shape[0], 4, 4))).square().mean()


def _plan(model, x, dtype=BF16):
    return ap.plan(model, ap.Mesh((2,), ("dp",)), args=(x,), data_parallel=ap.DataParallel("dp", param_dtype=dtype))


def _snapshot(model):
    return {n: (p.detach().clone(), p.dtype, p.device, p.requires_grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("how,op", [("qr", r"aten.linalg_qr.default \(node linalg_qr, module 'mix'\)"), ("fft", "")])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_policy_dtype_without_a_kernel_is_refused_while_planning(how, op, dtype):
    torch.manual_seed(0)
    model, x = Net(how), torch.randn(8, 8)
    before, rng = _snapshot(model), torch.get_rng_state()
    name = "BFloat16" if dtype == BF16 else "Half"
    where = op or r"module 'mix' \(at .*test_precision_kernels.py:\d+: return torch.fft.fft\(x, dim=-1\)"
    other = "has no kernel for it here either" if how == "qr" else ""
    fix = rf"(?s)Keep that op in fp32 in the forward of module 'mix': .*\.float\(\).*\.to\(x\.dtype\).*param_dtype=torch.float32.*{other}"
    with pytest.raises(
        ap.PlanError, match=rf"(?s)computes in {dtype}, but .*{where}.* has no kernel for {dtype}.*{name}"
    ):
        _plan(model, x, dtype)
    with pytest.raises(ap.PlanError, match=fix):
        _plan(model, x, dtype)
    # nothing half-planned: the user's parameters (values, dtypes, devices) and generator as they were
    after = _snapshot(model)
    assert before.keys() == after.keys()
    for n, (value, *rest) in before.items():
        assert torch.equal(after[n][0], value) and list(after[n][1:]) == rest, n
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(not hasattr(m, "autopar_plan") for m in model.modules())


@pytest.mark.filterwarnings("ignore:autopar. no sharding rule for aten.linalg_qr")  # gathered, as it says
@pytest.mark.parametrize("how", ["qr_fp32", "fft_fp32"])
def test_the_named_fix_plans_and_equals_the_serial_policy(how):
    """The op kept in fp32 by the model's own code: planned in bf16 (the fp32 island in the trace),
    its forward and gradients those of the serial model under the same policy (bf16 copies of the
    fp32 masters)."""
    torch.manual_seed(0)
    model, x = Net(how), torch.randn(8, 8)
    plan = _plan(copy.deepcopy(model), x)
    low = {n: p.to(BF16) for n, p in model.named_parameters()}
    want = torch.func.functional_call(model, low, (x.to(BF16),))
    want.backward()

    def step(m, a):
        loss = m(a)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    out = plan.simulate(step, x)
    grads = plan.merge_state_dicts([g for _, g in out])
    for loss, _ in out:  # each rank's mean of its half: the two together the serial mean
        assert loss.dtype == BF16
    torch.testing.assert_close(sum(loss.float() for loss, _ in out) / 2, want.float(), rtol=1e-2, atol=1e-3)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=2e-2, atol=2e-3, msg=n)


class FP32Positions(nn.Module):
    """XGLM's pattern: an fp32 buffer (sinusoidal positions) added to the bf16 activations, then a
    LayerNorm whose bf16 weights meet the fp32 sum: "mixed dtype" at the first step, under FSDP2's
    recipe too (the policy casts parameters and floating inputs, not buffers)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("positions", torch.randn(8))

    def forward(self, x):
        return self.norm(self.fc(x) + self.positions).square().mean()


def test_fp32_buffer_meeting_bf16_parameters_is_refused_while_planning():
    torch.manual_seed(0)
    model, x = FP32Positions(), torch.randn(8, 8)
    before = _snapshot(model)
    with pytest.raises(ap.PlanError, match=r"aten.layer_norm.default \(node \w+, module 'norm'\) reads tensors of "):
        _plan(model, x)
    for name, (value, dtype, device, grad) in before.items():  # nothing half-planned
        p = model.get_parameter(name)
        assert torch.equal(p, value) and (p.dtype, p.device, p.requires_grad) == (dtype, device, grad)
    assert model.positions.dtype == torch.float32
    # the serial recipe (bf16 copies of the parameters, the buffer as it is) fails the same way
    low = {n: p.detach().to(BF16) for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="mixed dtype"):
        torch.func.functional_call(model, low, (x.to(BF16),))
