"""Context parallel folded into the FSDP group (``ap.DataParallel("dp", zero=3, shard_axes=("dp",
"cp"))``, torchtitan's dp_shard_cp): ZeRO's state sharded over the dp x cp ranks together, one
reduce-scatter over them instead of dp's reduce-scatter and cp's all-reduce. Against serial on the
LLaMA-style model (load balanced, ring and all-gather): outputs, every gradient and the parameters
after 3 AdamW steps on (2, 2) dp x cp and (2,)/(4,) cp only; ZeRO-1/2 folded the same way; with tp
on (2, 2, 2); HSDP's groups; memory, collectives, cost and explain; bad input. Gloo and DCP:
tests/gloo/test_context_parallel.py, tests/gloo/test_checkpoint.py."""

from __future__ import annotations

import functools

import pytest
import torch

import autopar as ap
from autopar.parallel.data_parallel.fsdp import groups
from autopar.runtime.simulator import run_ranks
from tests.harness.llama_like import TP, llama_batch, llama_like
from tests.harness.serial import assert_params_close, serial_step

BATCHES = [llama_batch(batch=4, seed=s) for s in range(3)]
ADAMW = dict(lr=0.01, weight_decay=0.1, eps=1e-3)  # eps well above float noise: AdamW divides by sqrt(v)
FOLD = ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp"))
CP_ONLY = ap.DataParallel(zero=3, shard_axes=("cp",))


def _plan(shape, axes, dp, method="ring", **kw):
    cp = ap.ContextParallel("cp", method=method, load_balance=True)
    return ap.plan(llama_like(), ap.Mesh(shape, axes), args=BATCHES[0], data_parallel=dp, context_parallel=cp, **kw)


@functools.cache
def _dp2xcp2():
    return _plan((2, 2), ("dp", "cp"), FOLD, "allgather")


@functools.cache
def _serial() -> tuple[dict, float]:
    """The serial model's parameters after 3 AdamW steps, and its first gradient's norm."""
    model = llama_like()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    norm = None
    for batch in BATCHES:
        model(*batch)[1].backward()
        norm = norm or torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters()), norm


def _train(plan) -> tuple[dict, list[int]]:
    """3 AdamW steps on every rank (ap.ZeroOptimizer at zero 1/2); the merged parameters and each
    rank's optimizer-state bytes. The first gradient's norm (ap.clip_grad_norm_: each stored piece
    counted once over the dp x cp group) is serial's on every rank."""

    def step(rank):
        module = plan.build_module(rank)
        zero12 = plan.data_parallel.zero in (1, 2)
        opt = ap.ZeroOptimizer(module, torch.optim.AdamW, **ADAMW) if zero12 else torch.optim.AdamW(
            module.parameters(), **ADAMW
        )  # fmt: skip
        norm = None
        for batch in BATCHES:
            args, kwargs = plan.local_inputs(rank, *batch)
            module(*args, **kwargs)[1].backward()
            norm = norm or ap.clip_grad_norm_(module, 1e9).item()
            opt.step()
            opt.zero_grad()
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim())
        return {n: p.detach().clone() for n, p in module.named_parameters()}, state, norm

    out = run_ranks(plan.mesh.size, step)
    for _, _, norm in out:
        assert norm == pytest.approx(_serial()[1], rel=1e-5)
    return plan.merge_state_dicts([p for p, _, _ in out]), [s for _, s, _ in out]


def _full_state(plan) -> int:
    return sum(2 * p.numel() * p.element_size() for p in plan.model.parameters())  # AdamW: 2 slots


@pytest.mark.parametrize(
    "shape, axes, dp, method",
    [
        ((2, 2), ("dp", "cp"), FOLD, "ring"),
        ((2, 2), ("dp", "cp"), FOLD, "allgather"),
        ((4,), ("cp",), CP_ONLY, "ring"),
        ((2,), ("cp",), CP_ONLY, "allgather"),
        ((4,), ("cp",), CP_ONLY, "ulysses"),  # K/V heads repeated twice (issue 47)
    ],
)
def test_folded_zero3_equals_serial(shape, axes, dp, method):
    """The shard group is every rank (dp x cp, or the cp axis alone): each stores 1/size of the
    parameters; the gathers and reduce-scatters over it give serial's outputs and gradients, and
    3 AdamW steps on the pieces serial's parameters."""
    plan = _dp2xcp2() if (axes, method) == (("dp", "cp"), "allgather") else _plan(shape, axes, dp, method)
    n = plan.mesh.size
    assert all(groups(plan, r) == (tuple(range(n)), (r,)) for r in range(n))
    assert not plan.grad_buckets()  # no gradient sync left: the reduce-scatter summed the cp parts too
    plan.check(*BATCHES[0], loss=lambda out: out[1])
    got, state = _train(plan)
    assert_params_close(got, _serial()[0], "folded zero=3", rtol=1e-5, atol=1e-5)
    assert max(state) <= _full_state(plan) / n + 64 * 4 * 2 * n  # 1/n, and the buckets' padding


@pytest.mark.parametrize("zero, method", [(1, "allgather"), (2, "allgather"), (2, "ulysses")])
def test_folded_zero12_shard_optimizer_state_over_dp_x_cp(zero, method):
    """ZeRO-1/2 with shard_axes: one gradient bucket over both axes, all-reduced (1) or
    reduce-scattered (2) over the 4 ranks at once, each stepping its quarter; 3 AdamW steps equal
    serial (under Ulysses too)."""
    base = _dp2xcp2() if method == "allgather" else _plan((2, 2), ("dp", "cp"), FOLD, method)
    plan = base.with_data_parallel(ap.DataParallel("dp", zero=zero, shard_axes=("dp", "cp")))
    assert [b.axes for b in plan.grad_buckets()] == [(0, 1)]
    sync = [(c.kind, c.axis) for c in plan.collectives() if c.phase in ("grad sync", "optimizer")]
    assert sync == [("all_reduce" if zero == 1 else "reduce_scatter", "dp*cp"), ("all_gather", "dp*cp")]
    got, state = _train(plan)
    assert_params_close(got, _serial()[0], f"folded zero={zero}", rtol=1e-5, atol=1e-5)
    assert max(state) <= _full_state(plan) / 4 + 64
    mem = plan.memory_per_rank(0)
    assert mem["optimizer_state"] == pytest.approx(mem["optimizer_state_unsharded"] / 4, abs=64)


def test_state_memory_collectives_cost_and_explain():
    """Folding quarters the state a rank keeps on (2, 2) (halves it against zero=3 on dp alone);
    the collectives, plan.cost() and explain name the dp x cp group, and cp's gradient all-reduce
    is gone."""
    folded = _dp2xcp2()
    alone = folded.with_data_parallel(ap.DataParallel("dp", zero=3))
    fm, am = folded.memory_per_rank(0), alone.memory_per_rank(0)
    for key in ("params", "grads", "optimizer_state"):
        assert fm[key] == pytest.approx(am[key] / 2, rel=0.02), key
    assert fm["shard_size"] == 4 and am["shard_size"] == 2
    axes = {c.axis for c in folded.collectives() if c.node.startswith("fsdp bucket")}
    assert axes == {"dp*cp"}
    assert not [c for c in folded.collectives() if c.phase == "grad sync" and c.axis == "cp"]
    assert [c for c in alone.collectives() if c.phase == "grad sync" and c.axis == "cp"]  # the sum folding drops
    cost = folded.cost()
    dp, cp = cost.symbols["dp"], cost.symbols["cp"]
    assert cost.memory["params"] == fm["params_unsharded"] / (dp * cp)
    assert cost.at()["memory"]["params"] == pytest.approx(fm["params_unsharded"] / 4)
    assert "dp*cp" in cost.comm and cost.time()["comm"]["dp*cp"].free_symbols >= {dp, cp}
    text = str(folded.explain("blocks.0.gate.weight"))
    assert "gathered on dp*cp" in text and "rank 3" in text


@pytest.mark.parametrize("fold", [True, False])
def test_planned_sync_bytes_are_the_ones_that_run(fold):
    """The gathers and gradient reductions of a step, per kind and group, as plan.collectives()
    lists them and as they ran (ap.comm_stats): folded, one all-gather and one reduce-scatter
    over the 4 ranks; on dp alone, cp's all-reduce moves the stored pieces (1/dp of each
    parameter, Technique.stored_share), not the computed tensors."""
    plan = _dp2xcp2()
    plan = plan if fold else plan.with_data_parallel(ap.DataParallel("dp", zero=3))
    planned: dict = {}
    for c in plan.collectives():
        if c.phase == "grad sync" or c.node.startswith("fsdp bucket"):
            planned[(c.kind, c.axis)] = planned.get((c.kind, c.axis), 0) + c.bytes
    with ap.comm_stats() as stats:
        plan.simulate(lambda m, ids, labels: m(ids, labels)[1].backward(), *BATCHES[0])
    label = {(0, 1, 2, 3): "dp*cp", (0, 2): "dp", (0, 1): "cp"}
    ran: dict = {}
    for r in stats.for_rank(0):
        key = (r.kind, label[r.group])
        if key in planned:
            ran[key] = ran.get(key, 0) + r.bytes
    assert ran == planned
    assert set(planned) == (
        {("all_gather", "dp*cp"), ("reduce_scatter", "dp*cp")}
        if fold
        else {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "cp")}
    )


def test_with_tensor_parallel_on_three_axes():
    """(2, 2, 2) dp x cp x tp, Megatron layouts on tp: each tp coordinate's dp x cp ranks are one
    shard group holding 1/4 of that tp piece; outputs and every gradient equal serial."""
    plan = _plan((2, 2, 2), ("dp", "cp", "tp"), FOLD, "ring", annotations=TP)
    assert groups(plan, 1) == ((1, 3, 5, 7), (1,))
    plan.check(*BATCHES[0], loss=lambda out: out[1])


def test_hsdp_with_cp_folded_into_the_shard_groups():
    """HSDP over two mesh axes with cp folded in (torchtitan's dp_replicate x dp_shard_cp): shard
    groups of dp_shard x cp ranks, replicated across dp_replicate."""
    dp = ap.DataParallel("shard", zero=3, replicate_axis="rep", shard_axes=("shard", "cp"))
    plan = _plan((2, 2, 2), ("rep", "shard", "cp"), dp, "allgather")
    assert plan.data_parallel.shard_axes == ("rep_shard", "cp")
    assert groups(plan, 5) == ((4, 5, 6, 7), (1, 5))
    assert plan.memory_per_rank(0)["shard_size"] == 4
    plan.check(*BATCHES[0], loss=lambda out: out[1])


@pytest.mark.parametrize(
    "shape, axes, dp, cp, match",
    [
        ((2, 2), ("dp", "cp"), dict(zero=3, shard_axes=("dp", "cp")), None, "splits no tokens"),
        ((2, 2), ("dp", "tp"), dict(zero=3, shard_axes=("dp", "tp")), None, "splits no tokens"),
        ((2, 2, 2), ("dp", "tp", "cp"), dict(zero=3, shard_axes=("dp", "cp")), "cp", "adjacent"),
        ((2, 2), ("cp", "dp"), dict(zero=3, shard_axes=("dp", "cp")), "cp", "adjacent"),
    ],
)
def test_bad_folds_are_plan_errors(shape, axes, dp, cp, match):
    with pytest.raises(ap.PlanError, match=match):
        ap.plan(
            llama_like(), ap.Mesh(shape, axes), args=BATCHES[0], data_parallel=ap.DataParallel("dp", **dp),
            context_parallel=cp,
        )  # fmt: skip


def test_bad_options_are_plan_errors():
    with pytest.raises(ap.PlanError, match="comes first"):
        ap.DataParallel("dp", zero=3, shard_axes=("cp", "dp"))
    with pytest.raises(ap.PlanError, match="zero=1, 2 or 3"):
        ap.DataParallel("dp", shard_axes=("dp", "cp"))
    with pytest.raises(ap.PlanError, match="None only with shard_axes"):
        ap.DataParallel(zero=3)
    with pytest.raises(ap.PlanError, match="give the axis"):
        ap.DataParallel(zero=3, shard_size=2, shard_axes=("cp",))
    with pytest.raises(ap.PlanError, match="distinct"):
        ap.DataParallel("dp", zero=3, shard_axes=("dp", "dp"))
    dp = ap.DataParallel("dp", zero=3, shard_axes=["dp", "cp"])  # a plan file's list
    assert dp.shard_axes == ("dp", "cp") and ap.DataParallel.from_fields(dp.fields()) == dp


class Pooled(torch.nn.Module):
    """A head on the sequence's mean: its gradient is whole on cp (every cp rank computes it from
    the gathered mean), the embedding's arrives in parts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 5)

    def forward(self, ids, labels):
        return torch.nn.functional.cross_entropy(self.head(self.embed(ids).mean(1).tanh()), labels)


def test_gradient_whole_on_cp_is_counted_once():
    """A parameter whose gradient is not summed over cp (whole on every cp rank) enters the dp x cp
    reduce-scatter divided by |cp|, so the sum counts it once."""
    ids, labels = BATCHES[0][0], torch.arange(4) % 5
    plan = ap.plan(
        Pooled(), ap.Mesh((2, 2), ("dp", "cp")), args=(ids, labels), data_parallel=FOLD, context_parallel="cp"
    )
    cp = plan.mesh.axis_index("cp")
    assert cp not in plan.grad_sync_axes["head.weight"] and cp in plan.grad_sync_axes["embed.weight"]
    plan.check(ids, labels)


def test_pipeline_stages_shard_over_cp():
    """pp x cp (2, 2) with zero=3 over the cp ranks: each stage module gathers its own buckets
    over its cp group and reduce-scatters the step's micro-batches' gradients there; the loss and
    every gradient (the stored pieces merged back) equal the serial step's."""
    model, batch = llama_like(), llama_batch(batch=8)
    cp = ap.ContextParallel("cp", method="ring", load_balance=True)
    plan = ap.plan(
        model, ap.Mesh((2, 2), ("pp", "cp")), args=batch, context_parallel=cp, data_parallel=CP_ONLY,
        pipeline=ap.Pipeline("pp", microbatches=2),
    )  # fmt: skip
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    losses = run_ranks(plan.mesh.size, lambda r: runners[r].step(batch), timeout=60)
    serial_loss, serial_grads = serial_step(model, batch)
    per_rank = [{n: p.grad for n, p in r.named_parameters()} for r in runners]
    for technique in plan.options.techniques:  # the stored pieces back to each rank's computed tensors
        per_rank = technique.restored(plan, per_rank)
    grads = {}
    for state in per_rank:  # each stage's ranks hold its parameters: the first one found of each
        grads.update({n: g for n, g in state.items() if g is not None and n not in grads})
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(serial_grads)
    for n, g in serial_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_predict_counts_a_gradient_whole_on_cp_in_the_folded_group():
    """ap.predict (the search's cost model) of the folded plan: zero=3 shards every bucketed
    parameter over dp x cp, the head's (whole on cp) too, as plan.cost() counts it.
    (Folded plans in ap.predict and the search: tests/simulated/test_auto_fold.py.)"""
    ids, labels = BATCHES[0][0], torch.arange(4) % 5
    plan = ap.plan(
        Pooled(), ap.Mesh((2, 2), ("dp", "cp")), args=(ids, labels), data_parallel=FOLD, context_parallel="cp"
    )
    pred = ap.predict(plan, "cpu-gloo")
    assert pred["memory"] == pytest.approx(plan.cost().at()["peak_memory"], rel=1e-9)
    assert set(pred["sync_bytes"]) == {"dp*cp"}
