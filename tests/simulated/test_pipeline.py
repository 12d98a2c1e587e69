"""Pipeline parallelism, simulated: numerics against serial, skips, ties, eval, memory, balance."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.parallel.pipeline import PipelineError, schedules, timeline, with_pipeline
from autopar.cost.formulas import Numbers
from autopar.cost.op_time import node_flops
from autopar.parallel.pipeline.split import _candidates, _param_bytes, balanced_cuts
from autopar.trace.module_paths import module_paths
from autopar.runtime.simulator import run_ranks
from tests.harness.meshes import MESHES, PP
from tests.harness.models import SKIP_SPLITS, SkipNet, gpt_batch, gpt_plan as _gpt_plan, mse, skipnet_plan, small_gpt
from tests.harness.serial import covered, grad_errors, serial_step

SCHEDULES = [
    ("gpipe", 1, False),
    ("1f1b", 1, False),
    ("interleaved", 2, False),
    ("gpipe", 1, True),
    ("1f1b", 1, True),
    ("interleaved", 2, True),
]


@pytest.fixture(scope="module")
def gpt():
    model = small_gpt(layers=4)
    return model, gpt_batch(batch=8), serial_step(model, gpt_batch(batch=8))


_PLANS: dict = {}


def gpt_plan(name, gpt):
    """The module's GPT on a pipeline mesh (Megatron on tp where the mesh has it), planned once."""
    if name not in _PLANS:
        _PLANS[name] = _gpt_plan(name, model=gpt[0], batch=gpt[1], pipeline=ap.Pipeline("pp", microbatches=4))
    return _PLANS[name]


def run_step(plan, batch, labels=None, **kw):
    runners = [plan.pipeline_runner(r, **kw) for r in plan.mesh.ranks()]
    losses = run_ranks(plan.mesh.size, lambda r: runners[r].step(batch, labels), timeout=60)
    return runners, losses


@pytest.mark.parametrize("mesh", [m for m in PP if len(MESHES[m].shape) < 3])
@pytest.mark.parametrize("schedule,chunks,ckpt", SCHEDULES)
def test_gpt_step_equals_serial(gpt, mesh, schedule, chunks, ckpt):
    model, batch, (serial_loss, serial_grads) = gpt
    plan = with_pipeline(
        gpt_plan(mesh, gpt), ap.Pipeline("pp", microbatches=4, schedule=schedule, chunks=chunks, checkpoint=ckpt)
    )
    runners, losses = run_step(plan, batch)
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    errors = [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]
    assert not errors, errors[:5]
    assert not covered([r.params for r in runners], model)
    # each stage module holds only its own parameters
    for r in runners:
        for s, gm in r.modules.items():
            held = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
            assert held == {
                plan.attr_name(ph) for ph in plan.stage_layout.stages[s].attrs if plan.attr_name(ph) in held
            }


@pytest.mark.parametrize("schedule,chunks,ckpt", [("1f1b", 1, True), ("interleaved", 2, False)])
def test_3d_mesh_dp_pp_tp(gpt, schedule, chunks, ckpt):
    test_gpt_step_equals_serial(gpt, "dp2xpp2xtp2", schedule, chunks, ckpt)


@pytest.mark.parametrize("mesh", ["pp2", "dp2xpp2xtp2"])
def test_static_shapes_step_equals_serial_and_count_one_micro_batch(gpt, mesh):
    """dynamic=False with a pipeline: the batch dim is still exported dynamic (the runner cuts it
    into micro-batches; a stage traced at the whole batch failed on its first reshape), the step
    equals serial and each rank's activations are counted per micro-batch, as with dynamic=True
    (they were the whole batch's: m times too many)."""
    model, batch, (serial_loss, serial_grads) = gpt
    pipe = ap.Pipeline("pp", microbatches=4)
    static = _gpt_plan(mesh, model=model, batch=batch, pipeline=pipe, dynamic=False)
    runners, losses = run_step(static, batch)
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    errors = [e for r in static.mesh.ranks() for e in grad_errors(static, r, runners[r], serial_grads)]
    assert not errors, errors[:5]
    dynamic = gpt_plan(mesh, gpt)
    for r in static.mesh.ranks():
        assert static.memory_per_rank(r)["activations"] == dynamic.memory_per_rank(r)["activations"]
    # the sequence dim stays static, as asked
    idx = next(n for n in static.graph.nodes if n.op == "placeholder" and n.name in static.traced.user_inputs)
    assert [isinstance(d, torch.SymInt) for d in idx.meta["val"].shape] == [True, False]


def test_static_trace_given_a_pipeline_later_names_the_fix(gpt):
    """A plan traced static without a pipeline, given one by with_options: its stages take only
    the traced batch; the runner says so, and what to do, instead of a reshape failing."""
    model, batch, _ = gpt
    static = _gpt_plan("pp2", model=model, batch=batch, dynamic=False)
    plan = with_pipeline(static, ap.Pipeline("pp", microbatches=4))
    with pytest.raises(Exception, match=r"static batch \(8 rows.*pipeline=ap.Pipeline"):
        run_step(plan, batch)


def test_memory_in_flight_counts(gpt):
    """1F1B holds at most p micro-batches per rank (p - r on rank r), GPipe all m; checkpointing
    lowers the measured peak of saved activation bytes."""
    base = gpt_plan("pp4", gpt)
    m, p = 8, 4
    batch = gpt_batch(batch=16)
    peaks = {}
    for schedule, ckpt in (("1f1b", False), ("gpipe", False), ("1f1b", True)):
        plan = with_pipeline(base, ap.Pipeline("pp", microbatches=m, schedule=schedule, checkpoint=ckpt))
        runners, _ = run_step(plan, batch)
        held = [r.stats["max_in_flight"] for r in runners]
        assert held == ([min(p - r, m) for r in range(p)] if schedule == "1f1b" else [m] * p)
        peaks[(schedule, ckpt)] = [r.stats["peak_activation_bytes"] for r in runners]
    # the last rank holds one micro-batch at a time: recomputing it costs what keeping it does
    assert all(c < 0.6 * n for c, n in zip(peaks[("1f1b", True)][:-1], peaks[("1f1b", False)][:-1])), peaks
    assert all(g > f for g, f in zip(peaks[("gpipe", False)][:-1], peaks[("1f1b", False)][:-1])), peaks


def test_skip_connections_and_multi_tensor_boundaries():
    plan, x, y = skipnet_plan(metric=lambda out, lab: (out - lab).abs().mean())
    model = plan.model
    st = plan.stage_layout.stages
    assert [n for n, _ in st[0].send if plan.stage_layout.kinds[n] == "grad"] and any(
        len(d) >= 2 for _, d in st[0].send
    ), "block 0's output must go to several stages"
    assert len(st[2].recv) >= 3 and any(plan.stage_layout.kinds[n] == "tensor" for n, _ in st[2].recv)
    assert any(src == 0 for _, src in st[3].recv), "a value must skip from stage 0 to stage 3"
    runners, results = run_step(plan, (x,), y)
    serial_loss, serial_grads = serial_step(model, (x,), mse, y)
    ref = copy.deepcopy(model)
    metric = (ref(x) - y).abs().mean()
    for loss, met in results:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(met, metric.detach(), rtol=1e-5, atol=1e-6)
    errors = [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]
    assert not errors, errors
    # no loss: the last stage fails, and the ranks waiting on it stop instead of hanging
    bare = with_pipeline(plan, ap.Pipeline("pp", microbatches=2), split_before=list(SKIP_SPLITS))
    with pytest.raises(ap.SimulationError, match="no scalar loss"):
        run_step(bare, (x,))


def test_tied_weights_one_value_after_sgd(gpt):
    model, batch, _ = gpt
    plan = gpt_plan("pp2", gpt)
    lay = plan.stage_layout
    holders = {s.index for s in lay.stages for ph in s.attrs if plan.attr_name(ph) in ("wte.weight", "lm_head.weight")}
    assert holders == {0, 1}
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    serial = copy.deepcopy(model)
    opts = [torch.optim.SGD(r.parameters(), lr=0.5) for r in runners]
    sopt = torch.optim.SGD(serial.parameters(), lr=0.5)

    def step(r):
        loss = runners[r].step(batch)
        opts[r].step()
        return loss

    for _ in range(2):
        run_ranks(2, step)
        serial(*batch)[1].backward()
        sopt.step()
        sopt.zero_grad()
        for o in opts:
            o.zero_grad()
    wte, head = runners[0].params["wte.weight"], runners[1].params["lm_head.weight"]
    torch.testing.assert_close(wte, head, rtol=0, atol=0)
    torch.testing.assert_close(wte.detach(), serial.wte.weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", ["pp2", "pp4", "dp2xpp2", "pp2xtp2"])
def test_merge_state_dicts_of_runners_gives_the_serial_state(gpt, mesh):
    """Issue 40: merging the runners' parameters (or gradients) failed with a KeyError, each stage
    holding its own parameters and naming the tied weight its own way (the last stage
    ``lm_head.weight``, the first the serial ``wte.weight``). It gives the serial state dict."""
    model, batch, (_, serial_grads) = gpt
    plan = gpt_plan(mesh, gpt)
    runners, _ = run_step(plan, batch)
    last = {r.rank for r in runners if plan.stage_layout.n_stages - 1 in r.stage_ids}

    def named(r, value):  # what the user passed: the runner's parameters, the last stage's tie renamed
        rename = {"wte.weight": "lm_head.weight"} if r.rank in last else {}
        return {rename.get(n, n): value(p) for n, p in r.named_parameters()}

    params = plan.merge_state_dicts([named(r, lambda p: p) for r in runners])
    assert set(params) == set(model.state_dict())  # the tied weight under both serial names
    assert all(torch.equal(params[n], p) for n, p in model.state_dict().items())
    grads = plan.merge_state_dicts([named(r, lambda p: p.grad) for r in runners])
    for n, g in serial_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    whole = plan.merge_state_dicts([r.params for r in runners])  # every name each stage holds
    assert all(torch.equal(whole[n], p) for n, p in model.state_dict().items())


def test_forward_only_keeps_no_activations(gpt):
    model, batch, (serial_loss, _) = gpt
    plan = gpt_plan("pp2xtp2", gpt)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    losses = run_ranks(4, lambda r: runners[r].evaluate(batch, keep_outputs=True))
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    assert all(r.stats["max_in_flight"] == 0 and r.stats["peak_activation_bytes"] == 0 for r in runners)
    assert all(p.grad is None for r in runners for p in r.parameters())
    logits = torch.cat([o[0] for o in runners[-1].outputs])
    torch.testing.assert_close(logits, model(*batch)[0].detach(), rtol=1e-5, atol=1e-5)


class Uneven(nn.Module):
    """An MLP whose first layer is far wider than the rest."""

    def __init__(self, widths=(256, 16, 16, 16, 16, 16, 16, 16), d=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, w), nn.Tanh(), nn.Linear(w, d)) for w in widths)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_automatic_split_balances_an_uneven_model():
    torch.manual_seed(0)
    model = Uneven()
    x = torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("pp",)), args=(x,), pipeline=ap.Pipeline("pp", microbatches=2, loss=mse))
    costs = [s.cost for s in plan.stage_layout.stages]
    even = ap.plan(
        model,
        ap.Mesh((2,), ("pp",)),
        args=(x,),
        annotations={"layers.4": ap.split_before()},
        pipeline=ap.Pipeline("pp", microbatches=2, loss=mse),
    )
    even_costs = [s.cost for s in even.stage_layout.stages]
    order = [n for n in plan.graph.nodes if n.op not in ("placeholder", "output")]
    sizes = Numbers(plan.mesh)
    node_costs = [3.0 * float(node_flops(n, sizes)) + _param_bytes(n, set(plan.traced.param_fqn)) for n in order]
    best = min(max(sum(node_costs[:c]), sum(node_costs[c:])) for c in _candidates(order))
    assert max(costs) == pytest.approx(best) and max(costs) < max(even_costs), (costs, even_costs)
    assert "modules layers.1" in str(plan).split("stage 1 (")[1]  # the wide layer alone in stage 0
    text = str(plan)
    assert "stage 0 (pp rank 0)" in text and "automatic" in text
    y = torch.randn(8, 16)
    runners, losses = run_step(plan, (x,), y)
    serial_loss, serial_grads = serial_step(model, (x,), mse, y)
    torch.testing.assert_close(losses[0], serial_loss, rtol=1e-5, atol=1e-6)
    assert not [e for r in range(2) for e in grad_errors(plan, r, runners[r], serial_grads)]


def test_balanced_cuts_is_optimal():
    assert balanced_cuts([4, 1, 1, 1, 1], [1, 2, 3, 4], 2) == [1]
    assert balanced_cuts([1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5], 3) == [2, 4]
    assert balanced_cuts([1, 5, 1, 1, 5, 1], [2, 4], 2) == [2] or balanced_cuts([1, 5, 1, 1, 5, 1], [2, 4], 2) == [4]


def test_split_before_boundaries_and_errors(gpt):
    plan = with_pipeline(gpt_plan("pp2", gpt), ap.Pipeline("pp"), split_before=["blocks.2"])
    nodes = {n.name: n for n in plan.graph.nodes}
    s0, s1 = plan.stage_layout.stages
    assert "blocks.2" in module_paths(nodes[s1.nodes[0]])
    assert not any("blocks.2" in module_paths(nodes[n]) for n in s0.nodes)
    assert "split_before annotations" in str(plan)
    model, x = SkipNet(), torch.randn(4, 16)
    mesh = ap.Mesh((2,), ("pp",))
    with pytest.raises(PipelineError, match="make 3 stages"):
        ap.plan(
            model,
            mesh,
            args=(x,),
            annotations={"b1": ap.split_before(), "b2": ap.split_before()},
            pipeline=ap.Pipeline("pp"),
        )
    with pytest.raises(PipelineError, match="b9"):
        ap.plan(model, mesh, args=(x,), annotations={"b9": ap.split_before()}, pipeline=ap.Pipeline("pp"))
    with pytest.raises(PipelineError, match="need a pipeline"):
        ap.plan(model, mesh, args=(x,), annotations={"b1": ap.split_before()})
    with pytest.raises(PipelineError, match="pipeline axis"):
        ap.plan(model, mesh, args=(x,), annotations={"b1": ap.colwise("pp")}, pipeline=ap.Pipeline("pp"))
    with pytest.raises(PipelineError, match="divisible"):
        schedules.interleaved(4, 6, 2, 0)


def test_schedule_table_and_figure(gpt):
    plan = with_pipeline(gpt_plan("pp2", gpt), ap.Pipeline("pp", microbatches=4, schedule="1f1b"))
    table = plan.schedule_table(0)
    assert table.splitlines()[1].split()[2:] == ["F0", "F1", ".", "B0", "F2", "B1", "F3", "B2", ".", "B3"]
    fig = plan.timeline_figure()
    import matplotlib.figure

    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes[0].patches) == 2 * 2 * 4  # one bar per action: 2 ranks x (F + B) x 4 micro-batches
    runners, _ = run_step(plan, gpt[1])
    for r, runner in zip(range(2), runners):  # the runner ran exactly the schedule, in order
        assert [(e.kind, e.microbatch, e.stage) for e in runner.timeline] == [
            (a.kind, a.microbatch, a.stage) for a in schedules.build("1f1b", 2, 4)[r]
        ]
        assert all(e.end >= e.start and e.cpu >= 0 for e in runner.timeline)
    idle = timeline.replayed_idle(plan, [r.timeline for r in runners])
    assert len(idle) == 2 and all(0 <= v < 1 for v in idle)
    fig = plan.timeline_figure([r.timeline for r in runners])
    assert len(fig.axes[0].patches) == 16
    assert fig._repr_png_().startswith(b"\x89PNG")  # shows itself in Jupyter, no pyplot needed
    inter = with_pipeline(gpt_plan("pp2", gpt), ap.Pipeline("pp", microbatches=4, schedule="interleaved", chunks=2))
    labels = {t.get_text() for t in inter.timeline_figure().axes[0].texts}
    assert {"F0/0", "F0/2", "B3/3"} <= labels  # rank 0 runs stages 0 and 2: bars say which


def test_p2p_streams_shape_once_then_prefetch():
    """A stream's first message tells its shape; later ones can be posted ahead; a shape change fails."""
    from autopar.parallel.pipeline.p2p import SimChannel
    from autopar.runtime.simulator import SimBackend

    backend = SimBackend(2)
    a, b = SimChannel(backend, 0), SimChannel(backend, 1)
    assert not b.prefetch(0, 1, torch.float32, "h")  # shape not known yet
    a.send(torch.ones(2, 3), 1, 1, "h")
    a.send(torch.zeros(2, 3), 1, 2, "h")
    assert b.recv(0, 1, torch.float32, "h").sum() == 6
    assert b.prefetch(0, 2, torch.float32, "h")  # DistChannel would post this irecv now
    assert b.recv(0, 2, torch.float32, "h").shape == (2, 3)
    with pytest.raises(PipelineError, match="every micro-batch"):
        a.send(torch.ones(4, 3), 1, 3, "h")


@pytest.mark.parametrize("ckpt", [False, True])
def test_unmeasured_step_equals_serial_and_records_no_cpu_or_bytes(gpt, ckpt):
    """measure=False (a real job's default): no CPU clocks, no saved-tensor hook; the same step."""
    model, batch, (serial_loss, serial_grads) = gpt
    plan = with_pipeline(gpt_plan("pp2", gpt), ap.Pipeline("pp", microbatches=4, schedule="1f1b", checkpoint=ckpt))
    for _ in range(2):  # the second step reuses the schedule and the receives worked out in the first
        runners, losses = run_step(plan, batch, measure=False)
        for loss in losses:
            torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    errors = [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]
    assert not errors, errors[:5]
    for r in runners:
        assert all(e.cpu is None and e.end >= e.start for e in r.timeline)
        assert r.stats["peak_activation_bytes"] is None and r.stats["max_in_flight"] > 0
    idle = timeline.replayed_idle(plan, [r.timeline for r in runners])  # wall times stand in
    assert len(idle) == 2 and all(0 <= v < 1 for v in idle)


@pytest.mark.parametrize("mesh", ["pp2", "dp2xpp2"])
def test_sync_loss_false_leaves_the_loss_on_the_last_stage(gpt, mesh):
    """sync_loss=False: no collective for the loss; the last stage's ranks return their own mean
    (over their dp slice: the dp ranks' mean is serial's), the others None; gradients unchanged."""
    model, batch, (serial_loss, serial_grads) = gpt
    plan = gpt_plan(mesh, gpt)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    got = run_ranks(plan.mesh.size, lambda r: runners[r].step(batch, sync_loss=False), timeout=60)
    pp = plan.stage_layout.axis
    last = [r for r in plan.mesh.ranks() if plan.mesh.coords(r)[pp] == plan.mesh.shape[pp] - 1]
    assert all((v is None) == (r not in last) for r, v in enumerate(got)), got
    torch.testing.assert_close(torch.stack([got[r] for r in last]).mean(), serial_loss, rtol=1e-5, atol=1e-6)
    errors = [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]
    assert not errors, errors[:5]


def test_streams_keyed_by_input_shapes_across_steps(gpt):
    """The channel lives across steps: its streams are named by the micro-batch inputs' shapes,
    so a step with new shapes opens new streams and one with earlier shapes reuses theirs."""
    model, batch, (serial_loss, _) = gpt
    plan = gpt_plan("pp2", gpt)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    batches = (batch, gpt_batch(batch=4, seed=3), batch)

    def steps(r):  # one simulated job (one backend): the channel outlives each step
        out = []
        for b in batches:
            out.append((runners[r].step(b), runners[r]._ch))
            runners[r].holder.zero_grad(set_to_none=True)
        return out

    results = run_ranks(2, steps, timeout=60)
    for i, b in enumerate(batches):
        with torch.no_grad():
            serial = model(*b)[1]
        for rank_results in results:
            torch.testing.assert_close(rank_results[i][0], serial, rtol=1e-5, atol=1e-6)
    channels = [ch for _, ch in results[1]]
    assert channels[0] is channels[1] is channels[2]  # one channel: it remembers the shapes
    assert len(runners[1]._shape_ids) == 2  # two shapes of micro-batch inputs
    assert {stream[3] for _, stream in channels[0].got} == {0, 1}  # streams of each
