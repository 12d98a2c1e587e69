"""Tensor parallel's float8 collectives (parallel/float8/rule.py's Float8TensorParallel), as torchao's
Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput run them under sequence
parallelism: the column-parallel Linear's input is cast to fp8 on its sequence piece (the scale from
the whole input's amax) and all-gathered as fp8 bytes; the row-parallel Linear's output is
reduce-scattered in the compute dtype and its gradient all-gathered in fp8.

Held against the serial torchao float8 model (same recipe): the loss, every gradient and 3 AdamW
steps. The casts are elementwise with the whole tensor's scale, so the gathered fp8 values are the
serial ones bit for bit; what differs from serial is the order of the float32 sums (dp's gradient
sum, the row-parallel partial sums): 5e-5, the tolerance of tests/simulated/test_float8.py
(measured 6e-8). The bytes of every collective are held three ways: plan.collectives(), what ran
(ap.comm_stats) and ap.predict's comm_bytes.
"""

from __future__ import annotations

import pytest
import torch
import torchao.float8 as torchao_float8  # pinned in requirements-test.txt: missing is a broken set-up, not a skip
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.runtime.simulator import run_ranks
from tests.harness.float8 import eval_outputs, listed_and_ran_bytes, loss_grads

F8 = torch.ops.autopar.float8_mm.default
MESHES = {"tp2": ((2,), ("tp",)), "dp2xtp2": ((2, 2), ("dp", "tp"))}


class PreNormMLP(nn.Module):
    """Pre-norm residual MLP blocks (torchtitan's feed-forward shape: Linears without bias)."""

    def __init__(self, d=16, hidden=32, layers=2, bias=False):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm": nn.LayerNorm(d),
                    "fc1": nn.Linear(d, hidden, bias=bias),
                    "fc2": nn.Linear(hidden, d, bias=bias),
                }
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["fc2"](F.relu(layer["fc1"](layer["norm"](x))))
        return self.norm(x)


# Megatron's sequence parallel on the MLP: the residual stream split on the sequence (dim 1)
SP = {
    "layers.*.norm": ap.sequence_parallel("tp"),
    "layers.*.fc1": ap.colwise("tp"),
    "layers.*.fc2": ap.rowwise("tp", output=ap.Shard(1)),
    "norm": ap.sequence_parallel("tp"),
}


def _batches(n=3):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(4, 8, 16, generator=g) for _ in range(n)]
    # the whole batch's max on one rank's piece: sequence position 5 (tp rank 1), row 0 (dp rank 0)
    xs[0][0, 5, 3] = 40.0
    return xs


def _loss(out):
    return out.sin().square().mean() + out.mean()


def _model(bias=False):
    torch.manual_seed(0)
    return PreNormMLP(bias=bias)


def _plan(mesh="tp2", recipe="tensorwise", bias=False, **kw):
    shape, axes = MESHES[mesh]
    return ap.plan(
        _model(bias),
        ap.Mesh(shape, axes),
        args=(_batches(1)[0],),
        annotations=SP,
        data_parallel="dp" if "dp" in axes else None,
        float8=ap.Float8(recipe),
        **kw,
    )


def _lowerings(plan) -> list[str]:
    """Per float8_mm, the name of the lowering it runs with (the tp axis decides)."""
    from autopar.sharding.lowerings.base import lowering_for
    from autopar.sharding.propagate import layout_of

    return [lowering_for(layout_of(n).strategies)[0].name for n in plan.graph.nodes if n.target is F8]


def _serial(recipe="tensorwise", bias=False):
    cfg = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    return torchao_float8.convert_to_float8_training(_model(bias), config=cfg)


def _run(plan, steps=3, wrap=None, no_grad_first=False):
    """Per rank: the first batch's output and gradients, then the parameters after ``steps`` AdamW steps."""

    def rank(r):
        m = plan.build_module(r)
        run = wrap(m) if wrap else m
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        first = {}
        for i, x in enumerate(_batches(steps)):
            (a,), _ = plan.local_inputs(r, x)
            out = run(a)
            _loss(out).backward()
            if i == 0:
                first = {"out": out.detach().clone(), **{n: p.grad.clone() for n, p in m.named_parameters()}}
            opt.step()
            opt.zero_grad()
        return first, {n: p.detach().clone() for n, p in m.named_parameters()}

    results = run_ranks(plan.mesh.size, rank)
    return results, plan.merge_state_dicts([r[1] for r in results])


def _serial_run(steps=3, recipe="tensorwise", bias=False):
    model = _serial(recipe, bias)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    first = {}
    for i, x in enumerate(_batches(steps)):
        out = model(x)
        _loss(out).backward()
        if i == 0:
            first = {"out": out.detach().clone(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
        opt.step()
        opt.zero_grad()
    return first, {n: p.detach() for n, p in model.named_parameters()}


def _check_equal_serial(plan, results, merged, steps=3, atol=5e-5, trained_atol=1e-4):
    first, trained = _serial_run(steps)
    grads = plan.merge_state_dicts([{k: v for k, v in r[0].items() if k != "out"} for r in results])
    for n, g in first.items():
        if n != "out":
            torch.testing.assert_close(grads[n], g, rtol=0, atol=atol, msg=f"gradient of {n}")
    # the model's output leaves whole on tp (the loss reads it whole), each dp rank its rows
    dp = plan.mesh.shape[0] if "dp" in plan.mesh.axis_names else 1
    for rank, r in enumerate(results):
        want = first["out"].chunk(dp)[rank // (plan.mesh.size // dp)]
        torch.testing.assert_close(r[0]["out"], want, rtol=0, atol=atol, msg=f"forward on rank {rank}")
    for n, p in trained.items():
        torch.testing.assert_close(merged[n], p, rtol=0, atol=trained_atol, msg=f"{n} after {steps} AdamW steps")


def _without_fp8_collectives(monkeypatch):
    """float8_mm's rule without Float8TensorParallel's strategies: the same plan gathering the
    input (and the output gradient) in the compute dtype, casting after, as before them."""
    from autopar.parallel.float8 import rule
    from autopar.sharding.rules import registry

    full = registry._RULES[F8]

    def plain_float8_mm_rule(op):
        return [s for s in full(op) if s.lowering is rule.FLOAT8_SCALES]

    monkeypatch.setitem(registry._RULES, F8, plain_float8_mm_rule)


def _assert_bitwise(plans, runs, what):
    """Two plans' first-step outputs and gradients and trained parameters, merged, bit for bit."""
    merged = []
    for plan, (results, trained) in zip(plans, runs):
        grads = plan.merge_state_dicts([{k: v for k, v in r[0].items() if k != "out"} for r in results])
        merged.append(({**grads, **{f"out {i}": r[0]["out"] for i, r in enumerate(results)}}, trained))
    (a_first, a_trained), (b_first, b_trained) = merged
    for n, v in a_first.items():
        assert torch.equal(v, b_first[n]), (what, "first step", n)
    for n, p in a_trained.items():
        assert torch.equal(p, b_trained[n]), (what, n)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sequence_parallel_fp8_collectives_equal_serial_torchao(mesh, monkeypatch):
    """Forward, every gradient and 3 AdamW steps against serial torchao; and bit for bit the same
    plan gathering in the compute dtype (the fp8 cast is elementwise with the whole tensor's scale,
    so casting before the gather gives the values casting after does). Tolerance after 3 steps:
    1e-4, as without the fp8 collectives: on dp2 x tp2 a weight gradient of 1e-10 summed over dp in
    another order than serial's (1.7e-10 against 1.0e-10) moves AdamW's first step by 7e-5."""
    plan = _plan(mesh)
    # fc1 gathers its sequence-split input in fp8; fc2 reduce-scatters its output (gradient gathered in fp8)
    assert _lowerings(plan) == ["float8_gather_input", "float8_scatter_output"] * 2
    assert "tensor parallel in fp8: 2 read their input gathered, 2 gather their output gradient" in str(plan)
    results, merged = _run(plan)
    _check_equal_serial(plan, results, merged)
    _without_fp8_collectives(monkeypatch)
    plain = _plan(mesh)
    assert set(_lowerings(plain)) == {"float8_scales"}
    _assert_bitwise((plan, plain), ((results, merged), _run(plain)), f"{mesh}: against the compute-dtype gathers")


def _label(plan):
    """comm_stats' rank groups -> plan.collectives()' axis names."""
    out = {}
    for a, name in enumerate(plan.mesh.axis_names):
        for r in plan.mesh.ranks():
            out[plan.mesh.group((name,), r)] = name
    return out


@pytest.mark.parametrize("mesh", list(MESHES))
def test_fp8_bytes_listed_ran_and_predicted(mesh):
    """One step: every collective's bytes by kind and axis as plan.collectives() lists them and as
    they ran; the fp8 ones (1 byte per element on the wire) as listed at the float8 Linears; the
    activations' bytes as ap.predict counts them. The fp8 gathers move a quarter of the float32
    gathers the same plan runs without float8."""
    plan = _plan(mesh)
    label = _label(plan)
    planned, ran, stats = listed_and_ran_bytes(plan, label, _loss, _batches(1)[0])
    assert ran == planned
    f8_nodes = {n.name for n in plan.graph.nodes if n.target is F8}
    listed = sum(float(c.bytes) for c in plan.collectives() if c.kind == "all_gather" and c.node in f8_nodes)
    moved = sum(r.bytes for r in stats.for_rank(0) if r.kind == "all_gather" and r.itemsize == 1)
    # 2 blocks x (fc1's input forward + fc2's output gradient backward): pieces of 4 x 4 x 16 (/dp) in fp8
    dp = plan.mesh.shape[0] if mesh == "dp2xtp2" else 1
    assert listed == moved == 2 * 2 * (4 * 4 * 16 / dp)
    activations = {}
    for c in plan.collectives():
        if c.phase in ("forward", "backward"):
            activations[c.axis] = activations.get(c.axis, 0.0) + float(c.bytes)
    assert ap.predict(plan, "h100")["comm_bytes"] == pytest.approx(activations)
    hp = ap.plan(_model(), plan.mesh, args=(_batches(1)[0],), annotations=SP, data_parallel=plan.options.data_parallel)
    hp_gathers = sum(
        float(c.bytes) for c in hp.collectives() if c.kind == "all_gather" and c.axis == "tp" and c.node != "output"
    )
    assert listed == hp_gathers / 4


def test_rowwise_recipe_gathers_in_the_compute_dtype():
    """torchao's float8 tensor parallel is tensorwise only: the rowwise recipe's Linears take the
    plain strategies (the gather before them in the compute dtype)."""
    plan = _plan("tp2", recipe="rowwise")
    assert set(_lowerings(plan)) == {"float8_scales"}


def test_a_linear_with_bias_gathers_its_input_in_fp8_and_adds_its_bias_after_the_reduce_scatter():
    """With a bias the bias add is the row-parallel module's output: the reduce-scatter (and its
    gradient's gather) sits before that add, in the compute dtype; the column-parallel input's gather
    is in fp8 as without bias. Equal to serial torchao."""
    plan = _plan("tp2", bias=True)
    assert _lowerings(plan) == ["float8_gather_input", "float8_scales"] * 2
    results, merged = _run(plan, steps=1)
    first, _ = _serial_run(1, bias=True)
    grads = plan.merge_state_dicts([{k: v for k, v in r[0].items() if k != "out"} for r in results])
    for n, g in first.items():
        if n != "out":
            torch.testing.assert_close(grads[n], g, rtol=0, atol=5e-5, msg=n)


@pytest.mark.parametrize("mode", ["compiled", "checkpointed"])
def test_fp8_collectives_compiled_or_checkpointed_equal_serial(mode, monkeypatch):
    """Under torch.compile (aot_eager) and activation checkpointing (the recompute gathers the input
    in fp8 again, with the same scale): 3 AdamW steps on tp=2 equal serial torchao, and bit for bit
    the same plan gathering in the compute dtype."""
    kw = {"activation_checkpoint": ap.ActivationCheckpoint(pattern="layers.*")} if mode == "checkpointed" else {}
    wrap = (lambda m: torch.compile(m, backend="aot_eager")) if mode == "compiled" else None
    plan = _plan("tp2", **kw)
    assert _lowerings(plan) == ["float8_gather_input", "float8_scatter_output"] * 2
    with ap.comm_stats() as stats:
        results, merged = _run(plan, wrap=wrap)
    assert any(r.kind == "all_gather" and r.itemsize == 1 for r in stats.records), "no fp8 gather ran"
    _check_equal_serial(plan, results, merged)
    _without_fp8_collectives(monkeypatch)
    plain = _plan("tp2", **kw)
    _assert_bitwise((plan, plain), ((results, merged), _run(plain, wrap=wrap)), mode)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_fp8_collectives_in_eval_mode_without_grad_equal_serial(mesh):
    """Inference (eval mode, torch.no_grad): the input gathered in fp8, the output reduce-scattered,
    no backward; the output equals the serial torchao model's."""
    plan = _plan(mesh)
    x = _batches(1)[0]

    outs, stats = eval_outputs(plan, x)
    assert any(r.kind == "all_gather" and r.itemsize == 1 for r in stats.records)
    with torch.no_grad():
        want = _serial()(x)
    dp = plan.mesh.size // 2
    for r, out in enumerate(outs):
        torch.testing.assert_close(out, want.chunk(dp)[r // 2], rtol=0, atol=5e-5, msg=f"{mesh} rank {r}")


def test_with_zero3_fp8_weight_gather_equal_serial_and_bytes_as_listed():
    """Sequence parallel's fp8 collectives beside zero=3's fp8 weight gather (dp2 x tp2): the matmul
    reads the gathered fp8 input and the gathered fp8 weight; 3 AdamW steps bit for bit the plan
    gathering the weights in the compute dtype, within the tolerances above of serial torchao; every
    collective's bytes as listed."""

    def plan(gather):
        return ap.plan(
            _model(),
            ap.Mesh((2, 2), ("dp", "tp")),
            args=(_batches(1)[0],),
            annotations=SP,
            data_parallel=ap.DataParallel("dp", zero=3),
            float8=ap.Float8("tensorwise", fp8_all_gather=gather),
        )

    fp8 = plan(True)
    assert _lowerings(fp8) == ["float8_gather_input", "float8_scatter_output"] * 2
    label = {**_label(fp8), tuple(fp8.mesh.ranks()): "dp*tp"}
    planned: dict = {}
    for c in fp8.collectives():
        planned[(c.kind, c.axis)] = planned.get((c.kind, c.axis), 0) + float(c.bytes)
    with ap.comm_stats() as stats:
        results, merged = _run(fp8)
    ran: dict = {}
    for r in stats.for_rank(0):
        ran[(r.kind, label[r.group])] = ran.get((r.kind, label[r.group]), 0) + r.bytes
    assert ran == {k: 3 * v for k, v in planned.items()}  # 3 steps
    _check_equal_serial(fp8, results, merged)
    hp = plan(False)
    _assert_bitwise((fp8, hp), ((results, merged), _run(hp)), "zero=3 weights gathered in the compute dtype")


def test_linears_reading_one_input_share_its_fp8_gather():
    """A LLaMA-style model under presets.megatron(sequence_parallel=True): q, k and v (and gate and
    up) read one normed input, gathered once in fp8 (PrepareFloat8ModuleInput's point), listed once
    and run once; every gradient equals serial torchao's (the LM head left out, as torchtitan does)."""
    from autopar.parallel.float8.cost import lm_heads
    from tests.harness.llama_like import llama_batch, llama_like

    ids, labels = llama_batch(batch=2, seq=16)
    kw = {"input_ids": ids, "labels": labels}
    model = llama_like(d=32, layers=2)
    skip = lm_heads(model)
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, annotations=ann, float8=ap.Float8("tensorwise", skip=skip))
    gathers, scatters = _lowerings(plan).count("float8_gather_input"), _lowerings(plan).count("float8_scatter_output")
    assert (gathers, scatters) == (2 * 5, 2 * 2)  # q, k, v, gate, up; o_proj, down
    f8 = {n.name for n in plan.graph.nodes if n.target is F8}
    listed = [c for c in plan.collectives() if c.kind == "all_gather" and c.node in f8]
    # per block: one forward gather for q, k, v, one for gate, up; one backward gather per row-parallel output
    assert [c.phase for c in listed] == ["forward", "backward"] * 4

    grads, stats = loss_grads(plan, kw)
    fp8 = [r for r in stats.for_rank(0) if r.kind == "all_gather" and r.itemsize == 1]
    assert len(fp8) == len(listed) and sum(r.bytes for r in fp8) == sum(float(c.bytes) for c in listed)
    serial = torchao_float8.convert_to_float8_training(
        llama_like(d=32, layers=2), module_filter_fn=lambda m, fqn: fqn not in skip
    )
    serial(**kw)[1].backward()
    for n, p in serial.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_pipeline_stages_run_the_fp8_collectives_equal_serial_accumulation():
    """pp2 x tp2 with sequence parallel inside each stage (1F1B, 2 micro-batches): each stage gathers
    in fp8; the gradients equal the serial torchao model accumulating over the same micro-batches
    (a pipeline scales each micro-batch on its own: docs/float8.md)."""
    from tests.harness.models import mse

    x, y = _batches(1)[0], torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3))
    plan = ap.plan(
        _model(),
        ap.Mesh((2, 2), ("pp", "tp")),
        args=(x,),
        annotations={**SP, "layers.1": ap.split_before()},
        pipeline=ap.Pipeline("pp", microbatches=2, schedule="1f1b", loss=mse),
        float8=ap.Float8("tensorwise"),
    )
    assert _lowerings(plan) == ["float8_gather_input", "float8_scatter_output"] * 2
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    with ap.comm_stats() as stats:
        run_ranks(4, lambda r: runners[r].step((x,), y))
    assert any(r.kind == "all_gather" and r.itemsize == 1 for r in stats.records)
    serial = _serial()
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (mse(serial(xs), ys) / 2).backward()
    grads = plan.merge_state_dicts([{n: p.grad for n, p in r.named_parameters()} for r in runners])
    for n, p in serial.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=5e-5, msg=n)
