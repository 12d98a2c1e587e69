"""ap.Float8 (parallel/float8/): torchao's float8 recipes on every rank equal to the serial
torchao Float8Linear model (convert_to_float8_training with the same recipe).

Tolerances: tensorwise matches to float32 reduction order (the gradient sums over dp and the
row-parallel partial sums are added in another order than serial's one gemm): 5e-5 after 3
AdamW steps. The rowwise recipes round each gemm's output to bf16 (torchao's workaround for
_scaled_mm's axiswise fp32 output), so a sum of per-rank bf16 pieces differs from serial's one
bf16 rounding, and a value that moves by a bf16 ulp may round to the next fp8 value (an e4m3
step is 1/8 of it) in the next cast: gradients are compared by the norm of the difference,
below 3e-2 of the gradient's norm (measured: rounding the serial model's input to bf16 alone
moves its rowwise fc1 weight gradient by 3.3% of its norm, its tensorwise one by 7.2%; the
plans differ from serial by 1.5% at most)."""

from __future__ import annotations

import builtins
import copy

import pytest
import torch
import torchao.float8 as torchao_float8  # pinned in requirements-test.txt: missing is a broken set-up, not a skip

import autopar as ap
from tests.harness.float8 import loss_grads
from autopar.errors import PlanError
from autopar.runtime.simulator import run_ranks
from tests.harness.models import MLP, MLP_TP

# AdamW's first step moves a weight by about lr * g / (|g| + eps): with torch's eps of 1e-8 a
# gradient of 1e-10, summed in another order than serial's (6e-11 against 1.2e-10), moves the
# weight 5e-5 apart, and which side of 5e-5 it lands on depends on the CPU's kernels. eps=1e-6
# keeps that noise 100x below the tolerance while every other gradient still takes a full step.
ADAMW = dict(lr=0.01, eps=1e-6)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MESHES = {"tp2": ((2,), ("tp",)), "dp2xtp2": ((2, 2), ("dp", "tp")), "dp4": ((4,), ("dp",))}


def _batches(n=3):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(8, 16, generator=g) for _ in range(n)]
    xs[0][1, 5] = 40.0  # dp rank 0's rows hold the whole batch's max: the others scale by it too
    return xs


def _loss(out):
    return out.sin().square().mean() + out.mean()


def _model():
    torch.manual_seed(0)
    return MLP()


def _serial(recipe):
    return torchao_float8.convert_to_float8_training(
        _model(), config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    )


def _plan(mesh, recipe, model=None, **kw):
    shape, axes = MESHES[mesh]
    return ap.plan(
        model or _model(),
        ap.Mesh(shape, axes),
        args=(_batches(1)[0],),
        annotations=MLP_TP if "tp" in axes else {},
        data_parallel="dp" if "dp" in axes else None,
        **kw,
    )


def _train(plan, steps, wrap=None):
    def rank(r):
        m = plan.build_module(r)
        run = wrap(m) if wrap else m
        opt = torch.optim.AdamW(m.parameters(), **ADAMW)
        for x in _batches(steps):
            (a,), _ = plan.local_inputs(r, x)
            _loss(run(a)).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    return plan.merge_state_dicts(run_ranks(plan.mesh.size, rank))


def _serial_trained(recipe, steps):
    model = _serial(recipe)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for x in _batches(steps):
        _loss(model(x)).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def _grads(plan):
    def rank(r):
        m = plan.build_module(r)
        (a,), _ = plan.local_inputs(r, _batches(1)[0])
        out = m(a)
        _loss(out).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    return plan.merge_state_dicts(run_ranks(plan.mesh.size, rank))


@pytest.mark.parametrize("recipe", RECIPES)
def test_op_is_torchao_float8_linear_bitwise(recipe):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 24, bias=False)
    f8 = torchao_float8.convert_to_float8_training(
        torch.nn.Sequential(copy.deepcopy(lin)), config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    )[0]
    x = torch.randn(16, 32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = lin.weight.detach().clone().requires_grad_()
    y = torch.ops.autopar.float8_mm(x1, w, recipe, [], [], [], 0)
    y_ref = f8(x2)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(y, y_ref) and torch.equal(x1.grad, x2.grad) and torch.equal(w.grad, f8.weight.grad)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_tensorwise_three_adamw_steps_equal_serial(mesh):
    merged = _train(_plan(mesh, "tensorwise", float8=ap.Float8("tensorwise")), 3)
    for n, p in _serial_trained("tensorwise", 3).items():
        torch.testing.assert_close(merged[n], p, rtol=0, atol=5e-5, msg=f"{mesh} {n}")


@pytest.mark.parametrize("mesh", ["tp2", "dp2xtp2"])
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_gradients_equal_serial_to_bf16_rounding(mesh, recipe):
    grads = _grads(_plan(mesh, recipe, float8=ap.Float8(recipe)))
    serial = _serial(recipe)
    _loss(serial(_batches(1)[0])).backward()
    for n, p in serial.named_parameters():
        err = (grads[n] - p.grad).norm() / p.grad.norm()
        assert err < 3e-2, (mesh, recipe, n, float(err))


def test_the_scale_is_the_whole_tensors_not_the_pieces():
    """Without the amax reduction a rank whose piece lacks the 40.0 scales its piece alone: the
    gradients differ from serial far beyond float noise. With it they agree (tensorwise, dp=4)."""
    plan = _plan("dp4", "tensorwise", float8=ap.Float8("tensorwise"))
    serial = _serial("tensorwise")
    _loss(serial(_batches(1)[0])).backward()
    ok = _grads(plan)
    ref = serial.layers[0].fc1.weight.grad
    torch.testing.assert_close(ok["layers.0.fc1.weight"], ref, rtol=1e-5, atol=1e-6)
    per_piece = torch.zeros_like(ref)  # each rank's own scale: what the serial model does not do
    for xs in _batches(1)[0].chunk(4):
        m = _serial("tensorwise")
        _loss(m(xs)).backward()
        per_piece += m.layers[0].fc1.weight.grad / 4
    assert (per_piece - ref).abs().max() > 100 * (ok["layers.0.fc1.weight"] - ref).abs().max()


def test_masks_name_the_axes_that_split_each_cast():
    from autopar.parallel.float8.rule import F8, masks

    plan = _plan("dp2xtp2", "tensorwise", float8=ap.Float8("tensorwise"))
    fc1, fc2 = [n for n in plan.graph.nodes if n.target is F8][:2]
    # fc1 column-parallel: input split on dp (roles 0, 5), weight on tp (1, 3), output on both (2, 4)
    assert masks(fc1) == [0b110101, 0b011110]
    # fc2 row-parallel: input on dp and tp, weight on tp, output Partial on tp (its gradient whole)
    assert masks(fc2) == [0b110101, 0b101011]
    row = _plan("dp2xtp2", "rowwise", float8=ap.Float8("rowwise"))
    fc2 = [n for n in row.graph.nodes if n.target is F8][1]
    # rowwise: the input's rows (role 0) and the weight's rows (role 1) run over the split in-features
    assert masks(fc2) == [0b110000, 0b000011]


def test_skip_keeps_a_linear_in_high_precision_and_print_says_how_many():
    plan = _plan("tp2", "tensorwise", float8=ap.Float8("tensorwise", skip=("layers.1.*",)))
    from autopar.parallel.float8.rule import F8

    assert sum(n.target is F8 for n in plan.graph.nodes) == 2
    assert "2 Linear matmuls in float8" in str(plan)


def test_unknown_recipe_and_missing_torchao_say_how_to_fix(monkeypatch):
    with pytest.raises(PlanError, match="tensorwise, rowwise"):
        ap.Float8("delayed")
    real = builtins.__import__

    def no_torchao(name, *a, **k):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(PlanError, match="pip install torchao==0.18.0"):
        _plan("tp2", "tensorwise", float8=ap.Float8("tensorwise"))


def test_a_torchao_converted_model_plans_with_its_recipe():
    """convert_to_float8_training's model, float8= left out: its Float8Linears are traced as
    Linears and run float8_mm with their recipe; equal to the converted model trained serially."""
    plan = _plan("dp2xtp2", "tensorwise", model=_serial("tensorwise"))
    assert plan.options.float8 == ap.Float8("tensorwise")
    merged = _train(plan, 3)
    for n, p in _serial_trained("tensorwise", 3).items():
        torch.testing.assert_close(merged[n], p, rtol=0, atol=5e-5, msg=n)


def test_auto_float8_plans_run_equal_to_serial_torchao():
    """ap.Auto(float8=True) prices the Linears in float8 and its plan runs them so (the LM head
    left out, as torchtitan does): the loss and every gradient equal the serial converted model's."""
    from autopar.parallel.float8.cost import lm_heads
    from tests.harness.llama_like import llama_batch, llama_like

    ids, labels = llama_batch(batch=4, seq=16)
    kw = {"input_ids": ids, "labels": labels}
    auto = ap.Auto(device="h100", float8=True, pipeline=False)
    plan = ap.plan(llama_like(d=32, layers=2), ap.Mesh((2, 2), ("a", "b")), kwargs=kw, auto=auto)
    assert plan.options.float8 == ap.Float8("tensorwise", skip=lm_heads(llama_like(d=32, layers=2)))
    assert any(n.target is torch.ops.autopar.float8_mm.default for n in plan.graph.nodes)
    serial = torchao_float8.convert_to_float8_training(
        llama_like(d=32, layers=2), module_filter_fn=lambda m, fqn: fqn not in plan.options.float8.skip
    )
    loss = serial(**kw)[1]
    loss.backward()

    grads, _ = loss_grads(plan, kw)
    for n, p in serial.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tensorwise_with_zero_levels_equals_serial(zero):
    shape, axes = MESHES["dp2xtp2"]
    plan = ap.plan(
        _model(),
        ap.Mesh(shape, axes),
        args=(_batches(1)[0],),
        annotations=MLP_TP,
        data_parallel=ap.DataParallel("dp", zero=zero),
        float8=ap.Float8("tensorwise"),
    )

    def rank(r):
        m = plan.build_module(r)
        opt = (
            ap.ZeroOptimizer(m, torch.optim.AdamW, **ADAMW)
            if zero in (1, 2)
            else torch.optim.AdamW(m.parameters(), **ADAMW)
        )
        for x in _batches(3):
            (a,), _ = plan.local_inputs(r, x)
            _loss(m(a)).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    merged = plan.merge_state_dicts(run_ranks(4, rank))
    for n, p in _serial_trained("tensorwise", 3).items():
        torch.testing.assert_close(merged[n], p, rtol=0, atol=5e-5, msg=f"zero={zero} {n}")


def test_activation_checkpointing_recomputes_the_same_scales():
    plan = _plan(
        "dp2xtp2",
        "tensorwise",
        float8=ap.Float8("tensorwise"),
        activation_checkpoint=ap.ActivationCheckpoint(pattern="layers.*"),
    )
    merged = _train(plan, 3)
    for n, p in _serial_trained("tensorwise", 3).items():
        torch.testing.assert_close(merged[n], p, rtol=0, atol=5e-5, msg=n)


def test_compiled_rank_modules_equal_serial():
    plan = _plan("tp2", "tensorwise", float8=ap.Float8("tensorwise"))
    merged = _train(plan, 2, wrap=lambda m: torch.compile(m, backend="aot_eager"))
    for n, p in _serial_trained("tensorwise", 2).items():
        torch.testing.assert_close(merged[n], p, rtol=0, atol=5e-5, msg=n)


def test_pipeline_scales_each_microbatch_as_serial_accumulation_does():
    """A pipeline runs each micro-batch's forward and backward apart: its scales are the
    micro-batch's, as the serial float8 model's are when it accumulates gradients over the same
    micro-batches (the reference here); 4 stages, 2 micro-batches, 1F1B."""
    from tests.harness.models import SKIP_SPLITS, SkipNet, mse

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    x[1, 3] = 30.0  # in the first micro-batch only
    torch.manual_seed(0)
    model = SkipNet()
    serial = torchao_float8.convert_to_float8_training(copy.deepcopy(model))
    plan = ap.plan(
        model,
        ap.Mesh((4,), ("pp",)),
        args=(x,),
        annotations=SKIP_SPLITS,
        pipeline=ap.Pipeline("pp", microbatches=2, schedule="1f1b", loss=mse),
        float8=ap.Float8("tensorwise"),
    )
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    run_ranks(4, lambda r: runners[r].step((x,), y))
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (mse(serial(xs), ys) / 2).backward()
    grads = plan.merge_state_dicts([{n: p.grad for n, p in r.named_parameters()} for r in runners])
    for n, p in serial.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_plan_file_round_trip_keeps_float8(tmp_path):
    plan = _plan("tp2", "rowwise", float8=ap.Float8("rowwise", skip=("layers.1.fc2",)))
    plan.save(tmp_path / "p.json")
    again = ap.load_plan(tmp_path / "p.json", plan.model)
    assert again.options.float8 == ap.Float8("rowwise", skip=("layers.1.fc2",))
    f8 = torch.ops.autopar.float8_mm.default
    assert [n.name for n in again.graph.nodes if n.target is f8] == [n.name for n in plan.graph.nodes if n.target is f8]


def test_collectives_count_each_amax_reduction():
    """tensorwise: one float32 per reduced cast; rowwise: one per row of the rank's piece (fc2
    row-parallel on tp=2, batch 8: its input's 8 row amaxes and its weight's 16 row amaxes)."""
    from autopar.cost.formulas import Numbers
    from autopar.parallel.float8.rule import F8, FLOAT8_SCALES

    for recipe, want in (("tensorwise", [4, 4]), ("rowwise", [8 * 4, 16 * 4])):
        plan = _plan("tp2", recipe, float8=ap.Float8(recipe))
        fc2 = [n for n in plan.graph.nodes if n.target is F8][1]
        comms = FLOAT8_SCALES.comms(plan, fc2, 0, Numbers(plan.mesh))
        forward = [c for c in comms if c[2] == "forward"]
        # a ring all-reduce over 2 ranks moves the bytes once per rank
        assert [float(c[3]) for c in forward] == want, (recipe, forward)
