"""The training loop equals serial wherever a user takes it: torch.compile, dropout
(placement and serial RNG), train()/eval() with batch norm, no_grad and inference_mode.

Every test runs simulated on (2,), (4,) and (2, 2) against the serial model; the real gloo
runs of compile and dropout are in tests/gloo/test_training_loop.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from fuzz.modes import compare_with_serial
from tests.harness.meshes import MESHES as HM, TP

MESHES = [(HM[name].shape, HM[name].axes, HM[name].dp) for name in TP]  # (2,), (4,), (2, 2)
IDS = ["tp2", "tp4", "dp2xtp2"]
ANN = {"fc1": ap.colwise("tp"), "fc2": ap.rowwise("tp")}


class Net(nn.Module):
    """fc1 (column-parallel: split output) -> dropout -> fc2 (row-parallel: replicated output)
    -> dropout -> batch norm: dropout on a split and on a replicated tensor."""

    def __init__(self, p=0.0, norm=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(p)
        self.bn = nn.BatchNorm1d(16) if norm else nn.Identity()

    def forward(self, x):
        return self.bn(self.drop(self.fc2(self.drop(F.gelu(self.fc1(x))))))


def make_plan(mesh, p=0.0, norm=False, rng="placement", batch=8):
    shape, axes, dp = mesh
    torch.manual_seed(0)
    model, x = Net(p, norm), torch.randn(batch, 16)
    ap.sync_batch_norm(model)  # serial statistics on a split batch (the default is DDP's per-rank ones)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ap.plan(model, ap.Mesh(shape, axes), args=(x,), annotations=ANN, data_parallel=dp, rng=rng)
    return plan, x


@pytest.fixture(autouse=True)
def _enough_recompiles():
    # every rank of a simulated plan is a recompile of the same forward code
    import torch._dynamo

    old = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 64
    yield
    torch._dynamo.config.cache_size_limit = old


# ------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("mesh", MESHES, ids=IDS)
def test_compiled_rank_modules_match_serial(mesh):
    """Inductor: three calls of the same batch, forward and accumulated gradients equal serial
    (before the fix the f/scale_grad identity fast path ran inside compiled code: wrong grads)."""
    plan, x = make_plan(mesh)
    compare_with_serial(plan, (x,), wrap=torch.compile, calls=3)


def test_compiled_fullgraph_and_new_batch_size_recompiles():
    plan, x = make_plan(MESHES[2])
    compare_with_serial(plan, (x,), wrap=lambda m: torch.compile(m, fullgraph=True))
    compare_with_serial(plan, (torch.randn(12, 16),), wrap=torch.compile, calls=2)


@pytest.mark.parametrize("mesh", MESHES, ids=IDS)
def test_compiled_training_steps_match_serial(mesh):
    plan, x = make_plan(mesh, p=0.3, norm=True, rng="serial")
    serial = _train(plan.model, [lambda m: m], x, plan=None)
    got = _train(plan, [torch.compile], x, plan=plan)
    for name, want in serial.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)


def _train(model_or_plan, wrap, x, plan, steps=3):
    """Three SGD steps with dropout (seeded per step) and batch norm; the parameters after."""
    if plan is None:
        model = Net(0.3, norm=True)
        model.load_state_dict(model_or_plan.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            torch.manual_seed(step)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach() for n, p in model.named_parameters()}
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]
    runs = [wrap[0](m) for m in modules]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in modules]

    def one(module, xl):
        r = module.autopar_rank
        for step in range(steps):
            ap.manual_seed(module, step)
            out = runs[r](xl)
            out.pow(2).mean().backward()  # a dp rank's mean over its slice: the sync averages
            opts[r].step()
            opts[r].zero_grad()
        return {n: p.detach() for n, p in module.named_parameters()}

    inputs = [plan.local_inputs(r, x)[0] for r in plan.mesh.ranks()]
    from autopar.runtime.simulator import run_ranks

    return plan.merge_state_dicts(run_ranks(plan.mesh.size, lambda r: one(modules[r], *inputs[r])))


# ------------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("mesh", MESHES, ids=IDS)
def test_dropout_serial_rng_equals_serial_bit_for_bit(mesh):
    plan, x = make_plan(mesh, p=0.5, rng="serial")
    torch.manual_seed(7)
    want = plan.model(x)
    outs = plan.simulate(lambda m, xl: (ap.manual_seed(m, 7), m(xl))[1], x)
    got = plan.merge_outputs(outs)
    assert torch.equal(got == 0, want == 0) and (want == 0).any()  # the same elements dropped
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)  # tp sums in another order
    compare_with_serial(plan, (x,), seed=7, calls=2)  # gradients too, the generator advancing


@pytest.mark.parametrize("mesh", MESHES, ids=IDS)
def test_dropout_replicated_tensor_gets_one_mask_per_axis(mesh):
    """Default rng: fc2's output is replicated on tp, so every tp rank must drop the same
    elements (before: each rank drew its own mask and the replicas drifted apart)."""
    plan, x = make_plan(mesh, p=0.5)

    def step(m, xl):
        out = m(xl)
        out.pow(2).sum().backward()
        return out.detach(), m.fc2.bias.grad.clone(), m.fc1.weight.grad.clone()

    res = plan.simulate(step, x)
    tp = plan.mesh.axis_names.index("tp")
    for rank in plan.mesh.ranks():
        first = plan.mesh.group(tp, rank)[0]
        assert torch.equal(res[rank][0], res[first][0])  # replicated output: one value
        assert torch.equal(res[rank][1], res[first][1])  # replicated parameter: one gradient


def test_dropout_split_tensor_gets_its_own_piece():
    """fc1's output is split on tp: each rank draws its own piece, not copies of one mask."""

    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.drop = nn.Linear(16, 64), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.ones_like(self.fc1(x)))

    model, x = Split(), torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations={"fc1": ap.colwise("tp")})
    assert "autopar_runtime_rng_dropout" in plan.module(0).code
    full = plan.simulate(lambda m, xl: m(xl), x)[0]  # gathered: rank 0's piece | rank 1's piece
    assert full.shape == (8, 64) and not torch.equal(full[:, :32], full[:, 32:])
    assert 0.3 < (full == 0).float().mean() < 0.7


def test_rng_option_is_checked():
    with pytest.raises(ap.PlanError, match="rng='megatron'"):
        make_plan(MESHES[0], rng="megatron")


# ---------------------------------------------------------------------------- train/eval
@pytest.mark.parametrize("mesh", MESHES, ids=IDS)
def test_eval_mode_switches_dropout_and_batch_norm(mesh):
    """eval(): no dropout, running statistics used and left unchanged; train() switches back.
    Before, the traced mode (train) was frozen into the program."""
    plan, x = make_plan(mesh, p=0.5, norm=True, rng="serial")
    for ctx in (torch.no_grad, torch.inference_mode):
        compare_with_serial(plan, (x,), train=False, ctx=ctx, calls=2)
    gm = plan.module(0)
    before = gm.bn.running_mean.clone(), int(gm.bn.num_batches_tracked)
    gm.eval()
    outs = plan.simulate(lambda m, xl: m.eval()(xl), x)
    assert torch.equal(gm.bn.running_mean, before[0]) and int(gm.bn.num_batches_tracked) == before[1]
    again = plan.simulate(lambda m, xl: m(xl), x)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))  # eval: deterministic
    plan.simulate(lambda m, xl: m.train()(xl), x)
    assert not torch.equal(gm.bn.running_mean, before[0]) and int(gm.bn.num_batches_tracked) == before[1] + 1
    compare_with_serial(plan, (x,), train=True, seed=3)


def test_compiled_module_follows_train_eval():
    plan, x = make_plan(MESHES[2], p=0.5, norm=True, rng="serial")
    compare_with_serial(plan, (x,), wrap=torch.compile, train=False, ctx=torch.no_grad)
    compare_with_serial(plan, (x,), wrap=torch.compile, train=True, seed=5)


def test_the_loop_on_a_three_axis_mesh_with_zero3_dropout_eval_and_clipping():
    """The contracts together, as a user combines them: a GPT with dropout on (2, 2, 2) dp x a
    replicated axis x tp, parameters fully sharded over dp, serial-RNG dropout. Two training
    calls (forward and gradients) and an eval forward equal serial, and ap.clip_grad_norm_
    gives the serial norm (each piece counted once over the replicated axis too)."""
    from autopar.models.gpt import GPT, GPTConfig
    from fuzz.clip_mode import check_clipping
    from tests.harness.models import MEGATRON, gpt_batch

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1))
    idx, tg = gpt_batch()
    dp = ap.DataParallel("dp", zero=3)
    mesh = ap.Mesh((2, 2, 2), ("dp", "x", "tp"))
    plan = ap.plan(model, mesh, args=(idx, tg), annotations=MEGATRON, data_parallel=dp, rng="serial")
    compare_with_serial(plan, (idx, tg), train=True, seed=3, calls=2)
    compare_with_serial(plan, (idx, tg), train=False, ctx=torch.no_grad)
    model.eval()  # clipping compared without dropout: plan.check's objective draws no mask
    try:
        check_clipping(plan, (idx, tg))
    finally:
        model.train()
