"""ap.GradScaler: fp16 loss scaling with one skip decision on every rank (simulated; real gloo in
tests/gloo/jobs_training_loop.py). An inf in one rank's gradient piece makes every rank skip
and halve its scale; a normal fp16 autocast run equals serial torch.amp.GradScaler stepping,
on tp, dp (ZeRO 0-2), dp x tp and a pipeline; a plain GradScaler on rank pieces is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar as ap
from autopar.parallel.grad_scaler import stepped_tensors
from autopar.runtime.simulator import run_ranks
from tests.harness.meshes import MESHES
from tests.harness.models import MLP, MLP_TP, gpt_batch, small_gpt

LR = 0.1
FP16 = {"device_type": "cpu", "dtype": torch.float16}
# The first step overflows in fp16 (activation gradients past 65504, from 2**21 or so: where
# exactly differs by a factor 2 with how the batch is split), the scale backs off far below that
# and grows after 3 clean steps: a skip, steps and a growth, with no decision near the border.
SCALER = {"init_scale": 2.0**26, "backoff_factor": 2.0**-8, "growth_interval": 3}
GPT_SCALER = {**SCALER, "backoff_factor": 2.0**-12}  # the GPT overflows from 2**19 or so
CLEAN = {"init_scale": 2.0**10}  # no overflow of its own: an injected inf is the only one


def loss_of(out):
    return out.float().sin().square().mean() + out.float().mean()


def mlp_plan(mesh: str, zero: int = 0):
    spec = MESHES[mesh]
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    dp = ap.DataParallel("dp", zero=zero) if spec.dp else None
    ann = MLP_TP if "tp" in spec.axes else {}
    return ap.plan(model, spec.mesh(), args=(x,), annotations=ann, data_parallel=dp), x


def make_optimizer(module, zero: int, kind: str):
    if kind == "adafactor":  # gathers whole tensors: the scaler must unscale the pieces it gathers from
        return ap.Optimizer(module, torch.optim.Adafactor, lr=LR)
    if kind == "ap_sgd":
        return ap.Optimizer(module, torch.optim.SGD, lr=LR)
    if zero in (1, 2):
        return ap.ZeroOptimizer(module, torch.optim.SGD, lr=LR)
    return torch.optim.SGD(module.parameters(), lr=LR)


def serial_run(model, x, steps, kind="sgd", clip=None, scaler_kw=SCALER):
    """(parameters, scale after each step) of serial torch.amp.GradScaler stepping."""
    model = copy.deepcopy(model)
    opt = (
        torch.optim.Adafactor(model.parameters(), lr=LR)
        if kind == "adafactor"
        else torch.optim.SGD(model.parameters(), lr=LR)
    )
    scaler, scales = torch.amp.GradScaler("cpu", **scaler_kw), []
    for _ in range(steps):
        with torch.autocast(**FP16):
            out = model(x)
        scaler.scale(loss_of(out)).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return dict(model.named_parameters()), scales


def ranks_run(plan, x, steps, zero=0, kind="sgd", clip=None, inject=None, scaler_kw=SCALER):
    """(merged parameters, every rank's scales) of ap.GradScaler stepping each rank's module;
    ``inject``: rank whose first stepped gradient gets an inf at every step."""
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]
    opts = [make_optimizer(m, zero, kind) for m in modules]
    scalers = [ap.GradScaler(m, **scaler_kw) for m in modules]
    inputs = [plan.local_inputs(r, x)[0] for r in plan.mesh.ranks()]

    def step(r):
        scales = []
        for _ in range(steps):
            with torch.autocast(**FP16):
                out = modules[r](*inputs[r])
            scalers[r].scale(loss_of(out)).backward()
            if r == inject:
                next(t for t in stepped_tensors(opts[r]) if t.grad is not None).grad.view(-1)[0] = float("inf")
            if clip is not None:
                scalers[r].unscale_(opts[r])
                ap.clip_grad_norm_(modules[r], clip)
            scalers[r].step(opts[r])
            scalers[r].update()
            scales.append(scalers[r].get_scale())
            opts[r].zero_grad()
        return scales

    scales = run_ranks(plan.mesh.size, step)
    return plan.merge_state_dicts([dict(m.named_parameters()) for m in modules]), scales


CASES = [("tp2", 0), ("tp4", 0), ("dp2", 0), ("dp2", 1), ("dp2", 2), ("dp2", 3), ("dp2xtp2", 0), ("dp2xtp2", 2)]


@pytest.mark.parametrize("mesh,zero", CASES)
def test_inf_in_one_rank_piece_every_rank_skips(mesh, zero):
    """The bug: rank 0 alone overflows; with torch's GradScaler rank 0 skips and the others step."""
    plan, x = mlp_plan(mesh, zero)
    before = {n: p.detach().clone() for n, p in plan.model.named_parameters()}
    params, scales = ranks_run(plan, x, steps=2, zero=zero, inject=0, scaler_kw=CLEAN)
    for r, s in enumerate(scales):
        assert s == [2.0**9, 2.0**8], f"rank {r}: {s}"
    for name, p in before.items():
        assert torch.equal(params[name], p), name


@pytest.mark.parametrize("mesh,zero", CASES)
def test_fp16_autocast_run_matches_serial_scaler(mesh, zero):
    plan, x = mlp_plan(mesh, zero)
    s_params, s_scales = serial_run(plan.model, x, steps=6)
    params, scales = ranks_run(plan, x, steps=6, zero=zero)
    assert s_scales[0] < SCALER["init_scale"] and s_scales[-1] > s_scales[0]  # skipped, then grew
    for r, s in enumerate(scales):
        assert s == s_scales, f"rank {r}: {s} vs serial {s_scales}"
    for name, p in s_params.items():
        torch.testing.assert_close(params[name], p.detach(), rtol=2e-3, atol=2e-3, msg=name)


@pytest.mark.parametrize(
    "mesh,zero,kind,clip",
    [("tp2", 0, "sgd", 0.05), ("dp2", 1, "sgd", 0.05), ("dp2", 2, "sgd", 0.05), ("tp2", 0, "adafactor", None),
     ("dp2", 1, "adafactor", None), ("dp2", 2, "adafactor", None)],
)  # fmt: skip
def test_unscale_then_clip_and_whole_tensor_optimizer(mesh, zero, kind, clip):
    """unscale_ before ap.clip_grad_norm_ clips the unscaled gradients (ZeRO-1: the full gradients
    the slices are views of, each once); an ap.Optimizer that gathers whole tensors (Adafactor)
    has the rank pieces it gathers from unscaled (ZeRO-2: the reduced slices)."""
    plan, x = mlp_plan(mesh, zero)
    s_params, s_scales = serial_run(plan.model, x, steps=4, kind=kind, clip=clip)
    params, scales = ranks_run(plan, x, steps=4, zero=zero, kind=kind, clip=clip)
    assert all(s == s_scales for s in scales)
    for name, p in s_params.items():
        torch.testing.assert_close(params[name], p.detach(), rtol=2e-3, atol=2e-3, msg=name)


def pipeline_run(plan, batch, steps, inject=None, scaler_kw=GPT_SCALER):
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    opts = [torch.optim.SGD(r.parameters(), lr=LR) for r in runners]
    scalers = [ap.GradScaler(r, **scaler_kw) for r in runners]

    def step(r):
        scales, losses = [], []
        for _ in range(steps):
            with torch.autocast(**FP16):
                losses.append(float(runners[r].step(batch, scaler=scalers[r])))
            if r == inject:
                next(p for p in runners[r].parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
            scalers[r].step(opts[r])
            scalers[r].update()
            scales.append(scalers[r].get_scale())
            opts[r].zero_grad()
        return scales, losses

    return runners, run_ranks(plan.mesh.size, step)


def test_pipeline_matches_serial_and_skips_together():
    model, batch = small_gpt(layers=2), gpt_batch(batch=8)
    plan = ap.plan(model, ap.Mesh((2,), ("pp",)), args=batch, pipeline=ap.Pipeline("pp", microbatches=2))
    serial, scaler = copy.deepcopy(model), torch.amp.GradScaler("cpu", **GPT_SCALER)
    opt, s_scales, s_losses = torch.optim.SGD(serial.parameters(), lr=LR), [], []
    for _ in range(4):
        with torch.autocast(**FP16):
            loss = serial(*batch)[1]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        s_scales.append(scaler.get_scale())
        s_losses.append(loss.item())
        opt.zero_grad()
    runners, results = pipeline_run(plan, batch, steps=4, scaler_kw=GPT_SCALER)
    for scales, losses in results:
        assert scales == s_scales
        torch.testing.assert_close(losses, s_losses, rtol=2e-3, atol=2e-3)  # unscaled losses
    for r in runners:
        for name, p in r.named_parameters():
            torch.testing.assert_close(p, serial.get_parameter(name), rtol=2e-3, atol=2e-3, msg=name)
    # an inf on stage 0 only: stage 1 skips too (fresh runners start from the model's weights)
    runners, results = pipeline_run(plan, batch, steps=1, inject=0, scaler_kw=CLEAN)
    assert [s for s, _ in results] == [[2.0**9], [2.0**9]]
    for r in runners:
        for name, p in r.named_parameters():
            assert torch.equal(p, model.get_parameter(name)), name


# (a plain scaler over an ap.Optimizer gathering whole tensors stops at torch's own "No inf checks
# were recorded": its whole-tensor copies hold no gradient before its step)
@pytest.mark.parametrize("zero,kind", [(0, "sgd"), (2, "sgd"), (0, "ap_sgd")])
def test_plain_grad_scaler_on_rank_pieces_is_refused(zero, kind):
    plan, x = mlp_plan("dp2xtp2", zero)
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]
    opts = [make_optimizer(m, zero, kind) for m in modules]
    scalers = [torch.amp.GradScaler("cpu", init_scale=1.0) for _ in modules]

    def step(r):
        out = modules[r](*plan.local_inputs(r, x)[0])
        scalers[r].scale(loss_of(out)).backward()
        scalers[r].step(opts[r])

    with pytest.raises(
        ap.SimulationError, match=r"torch.amp.grad_scaler.GradScaler steps \w+ over a rank .*ap.GradScaler\(module"
    ):
        run_ranks(plan.mesh.size, step)
    before = plan.merge_state_dicts([dict(m.named_parameters()) for m in modules])
    for name, p in plan.model.named_parameters():
        assert torch.equal(before[name], p), name  # refused before any weight moved


def test_plain_grad_scaler_on_a_plain_module_still_works():
    """The guard looks at rank modules only: serial training with torch's scaler is untouched."""
    model, x = MLP(), torch.randn(4, 16)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=LR), torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model(x))).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**16


def test_grad_scaler_needs_a_rank_module():
    with pytest.raises(ap.PlanError, match="rank module"):
        ap.GradScaler(torch.nn.Linear(2, 2))
