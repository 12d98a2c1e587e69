"""Data parallel at full strength, simulated: options, numerics against serial training,
collective counts and order, overlap, no_sync, frozen parameters, ZeRO memory, errors."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.parallel.data_parallel.zero import state_bytes as zero_state_bytes
from autopar.runtime.simulator import SimBackend, run_ranks
from tests.harness import data_parallel as H
from tests.harness.comm import Recorder, sync_calls
from tests.harness.meshes import DP
from tests.harness.serial import max_rel_diff

_PLANS: dict = {}


def plan_for(mesh_name, **options):
    if mesh_name not in _PLANS:
        _PLANS[mesh_name] = H.make_plan(mesh_name)
    return _PLANS[mesh_name].with_data_parallel(ap.DataParallel("dp", **options))


def run(plan, fn, backend=None):
    return run_ranks(plan.mesh.size, fn, timeout=30, backend=backend)


@pytest.mark.parametrize("option", list(H.OPTIONS))
@pytest.mark.parametrize("mesh_name", DP)
def test_three_steps_match_reference(mesh_name, option):
    plan = plan_for(mesh_name, **H.OPTIONS[option])
    for opt_name in H.OPTIMIZERS:
        merged = plan.merge_state_dicts(run(plan, lambda r: H.train_rank(plan, r, opt_name)))
        ref = H.reference(plan, opt_name)
        if option == "bf16":  # bf16 on the wire: close to fp32 (SGD), but not equal to it
            worst = max_rel_diff(merged, ref)
            assert 1e-6 < worst < (1e-2 if opt_name == "sgd" else 1e-1), worst
        else:
            H.compare(merged, ref, option, f"{mesh_name}/{option}/{opt_name}")


@pytest.mark.parametrize("option", ["buckets2", "zero2", "bf16"])
@pytest.mark.parametrize("mesh_name", ["dp4", "dp2xtp2"])
def test_one_collective_per_bucket_in_the_same_order_on_every_rank(mesh_name, option):
    plan = plan_for(mesh_name, **H.OPTIONS[option])
    rec = Recorder(SimBackend(plan.mesh.size))
    run(plan, lambda r: H.train_rank(plan, r, "sgd", H.batches(1)), backend=rec)
    buckets = plan.grad_buckets()
    per_step = len(buckets) * (2 if plan.data_parallel.zero else 1)  # ZeRO: + one all-gather per bucket
    planned = [c for c in plan.collectives() if c.phase in ("grad sync", "optimizer")]
    assert len(planned) == per_step
    for rank in plan.mesh.ranks():
        assert len(sync_calls(rec.calls[rank])) == per_step
    for group in plan.mesh.groups("dp"):  # same kinds, groups and sizes, in the same order
        seqs = [[(k, n) for k, _, n in rec.calls[r]] for r in group]
        assert all(s == seqs[0] for s in seqs), seqs


def test_first_bucket_launched_before_first_layer_backward():
    plan = plan_for("dp2", bucket_max_params=2)
    events = []

    def step(rank):
        module = plan.build_module(rank)
        module.get_parameter("layers.0.fc1.weight").register_post_accumulate_grad_hook(
            lambda p: events.append(("first layer grad", rank, ""))
        )
        (x,), _ = plan.local_inputs(rank, H.batches(1)[0])
        H.loss_of(module(x)).backward()

    run(plan, step, backend=Recorder(SimBackend(2), events))
    for rank in (0, 1):
        mine = [e[0] for e in events if e[1] == rank]
        assert mine.index("launch") < mine.index("first layer grad"), mine
    assert set(plan.grad_buckets()[0].names) == {"norm.weight", "norm.bias"}  # the last layer comes first


def test_no_sync_accumulates_locally_and_syncs_once():
    plan = plan_for("dp2")
    data = H.batches(3)
    rec = Recorder(SimBackend(2))

    def step(rank):
        module = plan.build_module(rank)
        with module.no_sync():
            for x in data[:2]:
                H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
        assert not rec.calls.get(rank)
        H.loss_of(module(plan.local_inputs(rank, data[2])[0][0])).backward()
        return {n: p.grad.clone() for n, p in module.named_parameters()}

    grads = plan.merge_state_dicts(run(plan, step, backend=rec))
    assert len(sync_calls(rec.calls[0])) == len(plan.grad_buckets())
    assert_grads_accumulated_like_serial(grads, data)


def assert_grads_accumulated_like_serial(grads, data):
    """Serial gradients summed over ``data`` equal the merged per-rank ones."""
    model = H.make_model()
    for x in data:
        H.loss_of(model(x)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)


def test_backward_twice_without_zero_grad_accumulates_like_serial():
    plan = plan_for("dp2", bucket_max_params=3)
    data = H.batches(2)

    def step(rank):
        module = plan.build_module(rank)
        for x in data:
            H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
        return {n: p.grad.clone() for n, p in module.named_parameters()}

    grads = plan.merge_state_dicts(run(plan, step))
    assert_grads_accumulated_like_serial(grads, data)


@pytest.mark.parametrize("zero", [1, 2])
def test_module_zero_grad_clears_zero_slices(zero):
    """A loop that clears with ``model.zero_grad()`` (not the ZeroOptimizer's) trains as serial:
    ZeRO-2's reduced slices were kept and added to the next step's (norm weights off by 2.6e-2)."""
    plan = plan_for("dp2", zero=zero)
    merged = plan.merge_state_dicts(run(plan, lambda r: H.train_rank(plan, r, "sgd", clear_with_module=True)))
    H.compare(merged, H.reference(plan, "sgd"), "fp32", f"dp2/zero{zero}/module.zero_grad")


def test_frozen_parameters_are_left_out():
    model = H.make_model()
    model.layers[0].fc1.requires_grad_(False)
    plan = H.make_plan("dp2", model)
    names = {n for b in plan.grad_buckets() for n in b.names}
    assert "layers.0.fc1.weight" not in names and "layers.1.fc1.weight" in names
    merged = plan.merge_state_dicts(run(plan, lambda r: H.train_rank(plan, r, "adamw")))
    serial = H.make_model()
    serial.layers[0].fc1.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in serial.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)
    for x in H.batches():
        H.loss_of(serial(x)).backward()
        opt.step()
        opt.zero_grad()
    H.compare(merged, dict(serial.named_parameters()), "default", "frozen")


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_parameters_without_gradient_do_not_hang():
    torch.manual_seed(0)
    model = TwoHeads()
    plan = ap.plan(
        model, ap.Mesh((2,), ("dp",)), args=(H.batches(1)[0],), data_parallel=ap.DataParallel("dp", bucket_max_params=1)
    )
    assert len(plan.grad_buckets()) == 4

    def step(rank):
        module = plan.build_module(rank)
        a, _ = module(*plan.local_inputs(rank, H.batches(1)[0])[0])
        H.loss_of(a).backward()  # head b gets no gradient on any rank
        return {n: p.grad.clone() for n, p in module.named_parameters()}

    grads = plan.merge_state_dicts(run(plan, step))
    assert grads["b.weight"].abs().max() == 0
    H.loss_of(model(H.batches(1)[0])[0]).backward()
    torch.testing.assert_close(grads["a.weight"], model.a.weight.grad, rtol=1e-5, atol=1e-7)


def test_zero_optimizer_state_is_one_dp_th_per_rank():
    for stage in (1, 2):
        plan = plan_for("dp4", zero=stage, bucket_max_params=3)

        def step(rank):
            module = plan.build_module(rank)
            opt = ap.ZeroOptimizer(module, torch.optim.AdamW, lr=0.01)
            H.loss_of(module(plan.local_inputs(rank, H.batches(1)[0])[0][0])).backward()
            grads_left = sum(p.grad is not None for p in module.parameters())
            opt.step()
            return opt.state_bytes(), grads_left

        out = run(plan, step)
        model = H.make_model()
        full = torch.optim.AdamW(model.parameters(), lr=0.01)
        H.loss_of(model(H.batches(1)[0])).backward()
        full.step()
        unsharded = zero_state_bytes(full)
        moments = 2 * 4 * sum(p.numel() for p in model.parameters())  # exp_avg, exp_avg_sq in fp32
        per_rank = [b for b, _ in out]
        pad = 2 * 4 * 3 * len(plan.grad_buckets())  # at most dp-1 padding floats per bucket and slot
        scalars = 4 * 10 * len(plan.grad_buckets())  # AdamW's 'step' scalar per piece
        assert unsharded >= moments
        assert all(moments / 4 - pad <= b <= moments / 4 + pad + scalars for b in per_rank), (per_rank, moments)
        predicted = plan.memory_per_rank(0, state_slots=2)
        assert predicted["optimizer_state"] * 4 <= predicted["optimizer_state_unsharded"] + 2 * pad
        assert all(left == 0 for _, left in out) if stage == 2 else all(left > 0 for _, left in out)


def test_zero_param_groups_are_the_same_on_every_rank():
    """A group none of whose parameters fall in a rank's ZeRO slice (the final norm, on dp4) stays
    on that rank, empty: groups are matched by position in checkpoints and LR schedulers, so
    dropping it gave its weight_decay=0 to the decayed group on resume. Training equals serial
    AdamW with the same groups."""
    plan = plan_for("dp4", zero=1)
    groups = [{"params": ["norm.*"], "weight_decay": 0.0, "lr": 0.02}]

    def step(rank):
        module = plan.build_module(rank)
        opt = ap.ZeroOptimizer(module, torch.optim.AdamW, param_groups=groups, lr=0.01, weight_decay=0.1)
        for x in H.batches():
            H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
            opt.step()
            opt.zero_grad()
        kept = [(g["weight_decay"], g["lr"], len(g["params"])) for g in opt.param_groups]
        return kept, {n: p.detach().clone() for n, p in module.named_parameters()}

    out = run(plan, step)
    kept = [k for k, _ in out]
    assert [[(wd, lr) for wd, lr, _ in k] for k in kept] == [[(0.0, 0.02), (0.1, 0.01)]] * 4
    assert any(n == 0 for k in kept for _, _, n in k)  # some rank owns no norm piece: the bug's case
    model = H.make_model()
    norm = [p for n, p in model.named_parameters() if n.startswith("norm.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("norm.")]
    opt = torch.optim.AdamW(
        [{"params": norm, "weight_decay": 0.0, "lr": 0.02}, {"params": rest}], lr=0.01, weight_decay=0.1
    )
    for x in H.batches():
        H.loss_of(model(x)).backward()
        opt.step()
        opt.zero_grad()
    H.compare(plan.merge_state_dicts([p for _, p in out]), dict(model.named_parameters()), "zero1", "param groups")


def test_options_are_checked():
    with pytest.raises(ap.DataParallelError, match="zero"):
        ap.DataParallel("dp", zero=4)  # 3 is fully sharded (test_fsdp.py)
    with pytest.raises(ap.DataParallelError, match="exclude"):
        ap.DataParallel("dp", zero=1, local_sgd_every=2)
    with pytest.raises(ap.DataParallelError, match="reduce_dtype"):
        ap.DataParallel("dp", reduce_dtype=torch.int8)
    plan = plan_for("dp2", zero=2)

    def plain_optimizer(rank):
        module = plan.build_module(rank)
        H.loss_of(module(plan.local_inputs(rank, H.batches(1)[0])[0][0])).backward()

    with pytest.raises(ap.SimulationError, match=r"ap.Optimizer\(module, torch.optim.AdamW, lr=...\) in place of"):
        run(plan, plain_optimizer)
    with pytest.raises(ap.DataParallelError, match="whole parameter"):
        ap.ZeroOptimizer(plan.build_module(0), torch.optim.LBFGS)


def test_plain_name_keeps_defaults_and_plan_records_options():
    plan = plan_for("dp2")
    assert _PLANS["dp2"].data_parallel == ap.DataParallel("dp")
    assert plan.grad_buckets() == plan.grad_buckets(1)
    zero = plan_for("dp2", zero=2, bucket_max_params=3)
    kinds = [c.kind for c in zero.collectives() if c.phase in ("grad sync", "optimizer")]
    assert kinds == ["reduce_scatter", "all_gather"] * len(zero.grad_buckets())


@pytest.mark.parametrize("option", ["zero1", "zero2", "localsgd2"])
def test_no_sync_accumulation_then_step(option):
    """Accumulate 2 micro-batches under no_sync, sync on the 3rd, step: as serial on all 3."""
    plan = plan_for("dp2xtp2", **H.OPTIONS[option])
    data = H.batches(3)

    def step(rank):
        module = plan.build_module(rank)
        opt = H.make_optimizer(module, "adamw", plan.data_parallel.zero)
        with module.no_sync():
            for x in data[:2]:
                H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
        H.loss_of(module(plan.local_inputs(rank, data[2])[0][0])).backward()
        opt.step()
        if option == "localsgd2":
            module.autopar_local_sgd.average()
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    merged = plan.merge_state_dicts(run(plan, step))
    models = [H.make_model() for _ in range(2)]  # local SGD: one replica per dp rank, then the average
    for i, model in enumerate(models if option == "localsgd2" else models[:1]):
        opt = torch.optim.AdamW(model.parameters(), **H.OPTIMIZERS["adamw"][1])
        for x in data:
            H.loss_of(model(x.chunk(2)[i] if option == "localsgd2" else x)).backward()
        opt.step()
    ref = {n: p.detach() for n, p in models[0].named_parameters()}
    if option == "localsgd2":
        ref = {n: (p + models[1].get_parameter(n).detach()) / 2 for n, p in ref.items()}
    H.compare(merged, ref, option, f"no_sync {option}")


def test_tp_sharded_gradients_are_reduced_over_dp_only():
    plan = plan_for("dp2xtp2", bucket_max_params=1)
    axes = {b.names[0]: b.axes for b in plan.grad_buckets()}
    assert axes["layers.0.fc1.weight"] == (0,) and axes["norm.weight"] == (0,)
    rec = Recorder(SimBackend(4))
    run(plan, lambda r: H.train_rank(plan, r, "sgd", H.batches(1)), backend=rec)
    for rank in plan.mesh.ranks():
        assert {g for _, g, _ in sync_calls(rec.calls[rank])} == {plan.mesh.group("dp", rank)}


@pytest.mark.parametrize("loss_mean", ["global", "per_rank"])
def test_float64_cross_entropy_over_split_rows_stays_float64(loss_mean):
    """A float64 GPT's cross-entropy over dp-split rows: the rank's sum and count are reduced in
    float64 (a float32 pair moved the loss by ~1e-8), so every rank's loss is serial's to 1e-12."""
    from tests.harness.models import NanoGPTLoss, gpt_batch

    model = NanoGPTLoss().double()
    idx, tg = gpt_batch(batch=4, seq=8)
    dp = ap.DataParallel("dp", loss_mean=loss_mean)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(idx, tg), data_parallel=dp)
    want = model(idx, tg).item() if loss_mean == "global" else None
    losses = plan.simulate(lambda m, *a: m(*a), idx, tg)
    if want is None:  # the mean of the ranks' own means
        want = sum(model(*(t[2 * r : 2 * r + 2] for t in (idx, tg))).item() for r in range(2)) / 2
    assert all(x.dtype == torch.float64 and abs(x.item() - want) < 1e-12 * abs(want) for x in losses), losses
