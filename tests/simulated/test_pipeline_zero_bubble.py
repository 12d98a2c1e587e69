"""Zero-bubble pipelines (schedule="zb-h1", "zbv", "dualpipev"): the B/W split of a stage's backward,
the schedules, and training against serial (3 AdamW steps) with data parallel (zero 0-3), tp, and
checkpointing."""

from __future__ import annotations

import copy
import statistics

import matplotlib.figure

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.parallel.pipeline import schedules
from autopar.parallel.pipeline.split_backward import backward_input, backward_weight
from autopar.runtime.simulator import run_ranks
from tests.harness.meshes import MESHES
from tests.harness.models import GPT_SEQUENCE_PARALLEL, MEGATRON, gpt_batch, small_gpt
from tests.harness.serial import grad_errors, serial_step


class _Stage(nn.Module):
    """A weight read twice on the inputs' path (a.weight), the input read twice (a residual), and an
    output made from parameters and a user input alone (off the path: left wholly to W)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)
        self.c = nn.Parameter(torch.randn(4))

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        h = self.b(h) + self.a(h) + x
        return self.norm(h) * self.c, (y * self.c).sum() + self.c.sum()


@pytest.mark.parametrize("first", [False, True])
def test_b_then_w_equals_the_whole_backward(first):
    """B gives the input's gradient and leaves every weight's untouched; W then gives each weight's
    gradient: both equal one plain backward (on a first stage, with no input to send, W does all,
    the gradient of a user input that asks for one included)."""

    def outputs():
        torch.manual_seed(0)
        m = _Stage()
        x = torch.randn(3, 4, requires_grad=True)
        out = m(x, torch.randn(4))
        return m, x, list(out), [torch.randn(3, 4), torch.tensor(0.7)]

    m, x, out, seeds = outputs()
    torch.autograd.backward(out, seeds)
    want = {n: p.grad for n, p in m.named_parameters()}
    m, x2, out, seeds = outputs()
    wg, got = backward_input(out, seeds, [] if first else [x2])
    assert all(p.grad is None for p in m.parameters())  # B computed no weight gradient
    if not first:
        torch.testing.assert_close(got[0], x.grad, rtol=0, atol=0)
    backward_weight(wg)
    if first:
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-7)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (4, 2), (3, 1)])
def test_zb_h1_leaves_a_third_of_1f1b_bubble(pp, m):
    """Unit F, B, W: the step spans 3m + p - 1 slots for m >= p (1F1B with B + W as one action of
    two: 3(m + p - 1)), each rank holds at most p micro-batches (1F1B's first rank), no deadlock."""
    sched = schedules.build("zb-h1", pp, m)
    for r, acts in enumerate(sched):
        assert sorted(acts) == sorted(schedules.Action(k, i, r) for k in "FBW" for i in range(m))
        assert schedules.max_in_flight(acts) <= pp
    slots = schedules.replay(sched, pp)
    span = max(s.end for rs in slots for s in rs)
    one_f_one_b = schedules.replay(schedules.build("1f1b", pp, m), pp, lambda a: 1.0 if a.kind == "F" else 2.0)
    assert span < max(s.end for rs in one_f_one_b for s in rs)
    if m >= pp:
        assert span == 3 * m + pp - 1
        idle = schedules.idle_fraction(slots)
        assert max(idle) == pytest.approx(schedules.theoretical_bubble("zb-h1", pp, m))


def _plan(mesh: str, zero: int, ckpt: bool, schedule: str = "zb-h1"):
    """``mesh``: a named mesh; "+sp" after one with a tp axis: Megatron's sequence parallel (the
    residual stream split on the sequence dim, the embedding and head split by vocabulary)."""
    mesh, _, sp = mesh.partition("+")
    spec = MESHES[mesh]
    tp = (GPT_SEQUENCE_PARALLEL if sp else MEGATRON) if "tp" in spec.axes else {}
    chunks = 2 if schedule in schedules.V_SHAPED else 1
    pp = spec.shape[spec.axes.index("pp")]
    m = 2 * pp if schedule == "dualpipev" else 4  # DualPipeV needs 2pp micro-batches
    return ap.plan(
        small_gpt(layers=4 * chunks),
        spec.mesh(),
        args=gpt_batch(batch=8),
        annotations=tp,
        data_parallel=ap.DataParallel("dp", zero=zero) if spec.dp else None,
        pipeline=ap.Pipeline("pp", microbatches=m, schedule=schedule, chunks=chunks, checkpoint=ckpt),
    )


@pytest.mark.parametrize(
    "mesh,zero,ckpt,schedule",
    [
        ("pp2", 0, False, "zb-h1"),
        ("pp4", 0, True, "zb-h1"),
        ("dp2xpp2", 0, False, "zb-h1"),
        ("dp2xpp2", 1, True, "zb-h1"),
        ("dp2xpp2", 2, False, "zb-h1"),
        ("dp2xpp2", 3, False, "zb-h1"),
        ("pp2xtp2", 0, True, "zb-h1"),
        ("dp2xpp2xtp2", 2, False, "zb-h1"),
        ("pp2", 0, False, "zbv"),
        ("pp4", 0, True, "zbv"),
        ("dp2xpp2", 2, False, "zbv"),
        # a W after a forward on its stage: ZeRO-3 keeps its gathers (~10 s; in make test on 4 gloo
        # ranks: tests/gloo/test_pipeline.py)
        pytest.param("dp2xpp2", 3, True, "zbv", marks=pytest.mark.slow),
        ("pp2xtp2+sp", 0, False, "zbv"),
        # the other ZeRO levels under a V: the same data-parallel paths as ZB-H1's cases above
        pytest.param("dp2xpp2", 0, False, "zbv", marks=pytest.mark.slow),
        pytest.param("dp2xpp2", 1, True, "zbv", marks=pytest.mark.slow),
        pytest.param("dp2xpp2", 0, False, "dualpipev", marks=pytest.mark.slow),
        pytest.param("dp2xpp2", 2, True, "dualpipev", marks=pytest.mark.slow),
        pytest.param("pp2xtp2+sp", 0, True, "zb-h1", marks=pytest.mark.slow),  # sp: ZBV's case above
        ("pp2", 0, False, "dualpipev"),
        ("pp4", 0, True, "dualpipev"),
        ("dp2xpp2", 1, False, "dualpipev"),
        ("dp2xpp2", 3, False, "dualpipev"),
        ("pp2xtp2", 0, True, "dualpipev"),
        ("dp2xpp2xtp2", 2, False, "dualpipev"),
    ],
)
def test_zero_bubble_three_adamw_steps_equal_serial(mesh, zero, ckpt, schedule):
    plan = _plan(mesh, zero, ckpt, schedule)
    model = copy.deepcopy(plan.model)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    # eps 1e-4: the key bias's gradient is zero but for float noise (softmax ignores a constant
    # shift), which AdamW's first step divides by itself (+-lr either way, 1F1B's too)
    adamw = dict(lr=0.01, eps=1e-4)
    serial_opt = torch.optim.AdamW(model.parameters(), **adamw)

    def step(rank):
        opt = ap.Optimizer(runners[rank], torch.optim.AdamW, **adamw)
        losses = []
        for s in range(3):
            losses.append(runners[rank].step(gpt_batch(batch=8, seed=s)))
            if s == 2:  # the last step's gradients, before the optimizer, against serial's
                grads = {n: p.grad.clone() for n, p in runners[rank].named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
        return losses, grads, {n: p.detach().clone() for n, p in runners[rank].named_parameters()}

    per_rank = run_ranks(plan.mesh.size, step, timeout=120)
    serial_losses = []
    for s in range(3):
        loss = model(*gpt_batch(batch=8, seed=s))[1]
        loss.backward()
        serial_losses.append(loss.detach())
        if s == 2:
            serial_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        serial_opt.step()
        serial_opt.zero_grad()
    for rank, (losses, grads, params) in enumerate(per_rank):
        for got, want in zip(losses, serial_losses):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if zero < 2:  # ZeRO-2 keeps reduced slices of the gradients: the parameters below say it all
            ref = plan.shard_state_dict({n: g for n, g in serial_grads.items() if n in grads}, rank)
            for n, g in grads.items():
                torch.testing.assert_close(
                    g, ref[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"rank {rank} grad {n}: {m}"
                )
        ref = plan.shard_state_dict({n: p.detach() for n, p in model.named_parameters() if n in params}, rank)
        for n, p in params.items():
            torch.testing.assert_close(p, ref[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"rank {rank} {n}: {m}")


def test_zb_h1_table_figure_and_runner_order():
    """The table and the figure show W; each runner runs its schedule's actions in order, and holds
    at most pp micro-batches."""
    plan = _plan("pp2", 0, False)
    table = plan.schedule_table().splitlines()
    assert table[1].split()[2:] == ["F0", "F1", ".", "B0", "W0", "F2", "B1", "W1", "F3", "B2", "W2", "B3", "W3"]
    assert table[2].split()[2:] == [".", "F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "F3", "B3", "W2", "W3"]
    fig = plan.timeline_figure()
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes[0].patches) == 2 * 3 * 4  # 2 ranks x (F, B, W) x 4 micro-batches
    assert "W3" in {t.get_text() for t in fig.axes[0].texts}
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    run_ranks(2, lambda r: runners[r].step(gpt_batch(batch=8)), timeout=60)
    for r, runner in enumerate(runners):
        assert [(e.kind, e.microbatch, e.stage) for e in runner.timeline] == [
            tuple(a) for a in schedules.build("zb-h1", 2, 4)[r]
        ]
        assert runner.stats["max_in_flight"] == 2
    measured = plan.timeline_figure([r.timeline for r in runners])
    assert len(measured.axes[0].patches) == 24


def test_zero_bubble_chunks_are_checked():
    with pytest.raises(ap.PipelineError, match="zb-h1.*chunks=1"):
        ap.Pipeline("pp", schedule="zb-h1", chunks=2)
    with pytest.raises(ap.PipelineError, match="zbv.*chunks=2"):
        ap.Pipeline("pp", schedule="zbv")


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (2, 1), (3, 5)])
def test_zbv_places_stages_in_a_v_and_leaves_less_bubble_than_zb_h1(pp, m):
    """Rank r runs stages r and 2pp - 1 - r, every F, B and W of each once; no deadlock; on unit
    slots it idles less than ZB-H1 and holds at most 2pp micro-batch chunks (half a rank's layers
    each: 1F1B's first rank's pp micro-batches)."""
    sched = schedules.build("zbv", pp, m)
    for r, acts in enumerate(sched):
        stages = (r, 2 * pp - 1 - r)
        assert sorted(acts) == sorted(schedules.Action(k, i, s) for k in "FBW" for i in range(m) for s in stages)
        assert schedules.max_in_flight(acts) <= 2 * pp
        assert {schedules.v_rank(s, pp) for s in stages} == {r}
    idle = schedules.idle_fraction(schedules.replay(sched, 2 * pp))
    if m >= pp:
        assert max(idle) < schedules.theoretical_bubble("zb-h1", pp, m)
    assert max(idle) == pytest.approx(schedules.theoretical_bubble("zbv", pp, m))


def test_zbv_table_and_runner_order():
    plan = _plan("pp2", 0, False, "zbv")
    assert [plan.stage_layout.rank_of_stage(s) for s in range(4)] == [0, 1, 1, 0]
    assert "W3/3" in plan.schedule_table(0) and "F0/2" in plan.schedule_table(1)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    assert sorted(runners[0].modules) == [0, 3] and sorted(runners[1].modules) == [1, 2]
    run_ranks(2, lambda r: runners[r].step(gpt_batch(batch=8)), timeout=60)
    for r, runner in enumerate(runners):
        assert [(e.kind, e.microbatch, e.stage) for e in runner.timeline] == [
            tuple(a) for a in schedules.build("zbv", 2, 4)[r]
        ]


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_zero_bubble_uneven_micro_batches_and_evaluate(schedule):
    """6 rows in 4 micro-batches (2, 2, 1, 1: losses weighted by rows): the step's loss and every
    gradient equal serial's; ``evaluate`` runs the forwards only and gives serial's loss."""
    plan = _plan("pp2", 0, False, schedule)
    batch = gpt_batch(batch=6, seed=3)
    serial_loss, serial_grads = serial_step(plan.model, batch)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    losses = run_ranks(2, lambda r: runners[r].step(batch), timeout=60)
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    errors = [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]
    assert not errors, errors[:5]
    evals = run_ranks(2, lambda r: runners[r].evaluate(batch), timeout=60)
    for loss in evals:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    assert all(e.kind == "F" for r in runners for e in r.timeline)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 5), (4, 8), (4, 12), (3, 7)])
def test_dualpipev_places_stages_in_a_v_and_leaves_the_least_bubble(pp, m):
    """Rank r runs stages r and 2pp - 1 - r, every F, B and W of each once, without deadlock; each
    overlapped pair is a forward right before another micro-batch's backward on the same rank; on
    unit slots it idles no more than ZBV and under a third of 1F1B's bubble, holding at most
    2pp + 1 micro-batch chunks (half a rank's layers each)."""
    sched = schedules.build("dualpipev", pp, m, 2)
    pairs = schedules.overlapped("dualpipev", pp, m)
    for r, acts in enumerate(sched):
        stages = (r, 2 * pp - 1 - r)
        assert sorted(acts) == sorted(schedules.Action(k, i, s) for k in "FBW" for i in range(m) for s in stages)
        assert schedules.max_in_flight(acts) <= 2 * pp + 1
        assert pairs[r], r  # every rank has a steady phase (m >= 2pp)
        for f, b in pairs[r]:
            assert (f.kind, b.kind) == ("F", "B") and acts.index(b) == acts.index(f) + 1
            assert {f.stage, b.stage} == set(stages)  # one chunk's forward, the other's backward
    idle = max(schedules.idle_fraction(schedules.replay(sched, 2 * pp)))
    assert idle == pytest.approx(schedules.theoretical_bubble("dualpipev", pp, m))
    assert idle <= schedules.theoretical_bubble("zbv", pp, m) + 1e-9
    assert idle < schedules.theoretical_bubble("1f1b", pp, m) / 3


def test_dualpipev_options_are_checked():
    with pytest.raises(ap.PipelineError, match="dualpipev.*chunks=2"):
        ap.Pipeline("pp", schedule="dualpipev", microbatches=8)
    with pytest.raises(ap.PipelineError, match="at least 2 x pp.*microbatches >= 4"):
        ap.plan(
            small_gpt(layers=4),
            ap.Mesh((2,), ("pp",)),
            args=gpt_batch(batch=8),
            pipeline=ap.Pipeline("pp", microbatches=3, schedule="dualpipev", chunks=2),
        )


def test_dualpipev_table_figure_and_runner_order():
    """The table marks the overlapped pairs, the figure hatches them; each runner runs its
    schedule's actions in order."""
    plan = _plan("pp2", 0, False, "dualpipev")
    assert [plan.stage_layout.rank_of_stage(s) for s in range(4)] == [0, 1, 1, 0]
    table = plan.schedule_table().splitlines()
    assert table[2].split()[2:11] == [".", "F0/1", "F0/2", "F1/1", "F1/2", "F2/1", "B0/2", "W0/2", "F2/2*"]
    assert "overlapped" in table[-1]
    starred = sum(cell.endswith("*") for row in table[1:3] for cell in row.split())
    assert starred == 2 * sum(len(p) for p in schedules.overlapped("dualpipev", 2, 4))
    fig = plan.timeline_figure()
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert len(hatched) == starred and "overlapped" in fig.axes[0].get_title()
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    run_ranks(2, lambda r: runners[r].step(gpt_batch(batch=8)), timeout=60)
    for r, runner in enumerate(runners):
        assert [(e.kind, e.microbatch, e.stage) for e in runner.timeline] == [
            tuple(a) for a in schedules.build("dualpipev", 2, 4)[r]
        ]
    assert "1f1b" not in plan.schedule_table() and "*" not in _plan("pp2", 0, False, "zbv").schedule_table()


@pytest.mark.parametrize("mesh,zero,schedule", [("pp2", 0, "zb-h1"), ("pp2", 0, "dualpipev"), ("dp2xpp2", 3, "zb-h1")])
def test_split_backward_frees_each_stage_after_its_w(mesh, zero, schedule):
    """B and W keep the stage's graph (retain_graph) and W drops it: nothing of a step is left
    alive after it, with the runner's saved-bytes counter on (the simulator's default) and ZeRO-3's
    saved-tensor hooks. A pack hook returning the tensor itself made a cycle through C++ (an op
    saving its own output) that a retained graph never broke: the last stage kept ~91 KB per
    micro-batch for good, growing every step."""
    from autopar.runtime.live_bytes import LiveBytes

    plan = _plan(mesh, zero, False, schedule)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]

    def grown(rank):
        runners[rank].step(gpt_batch(batch=8))  # gradients allocated
        with LiveBytes() as mem:
            runners[rank].step(gpt_batch(batch=8, seed=1))
            after_one = mem.refresh().live
            runners[rank].step(gpt_batch(batch=8, seed=2))
            return mem.refresh().live - after_one

    for rank, growth in enumerate(run_ranks(plan.mesh.size, grown, timeout=60)):
        assert growth <= 64, (rank, growth)  # a step's loss values, not a stage's activations


@pytest.mark.parametrize("mesh,schedule", [("pp2", "dualpipev"), ("dp2xpp2", "zbv")])
def test_v_shaped_state_dicts_merge_to_serial(mesh, schedule):
    """Checkpoints under a V: rank 0 holds both end stages (the tied embedding and head on one
    rank); merging the runners' parameters and gradients after a step gives serial's."""
    plan = _plan(mesh, 0, False, schedule)
    batch = gpt_batch(batch=8)
    _, serial_grads = serial_step(plan.model, batch)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    run_ranks(plan.mesh.size, lambda r: runners[r].step(batch), timeout=60)
    held = [{n: p for n, p in r.params.items() if isinstance(p, nn.Parameter)} for r in runners]  # tied: both names
    params = plan.merge_state_dicts(held)
    assert set(serial_grads) <= set(params)
    assert all(torch.equal(params[n], p) for n, p in plan.model.named_parameters(remove_duplicate=False))
    grads = plan.merge_state_dicts([{n: p.grad for n, p in h.items()} for h in held])
    for n, g in serial_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_split_backward_costs_what_the_cost_model_charges():
    """The cost model prices a zero-bubble B and W at SPLIT_B and SPLIT_W of the stage's plain
    backward (FIRST_W: a first stage's W): measured again here, in CPU time on one thread, on a
    two-block stage of the bench's MLP (the bench's V chunk), the median of five runs each within
    0.25 of the constant. The constants are the bench's medians on the machine that set them (B 0.51,
    W 0.63); another machine of the same kind measured W 0.71-0.77 in medians of seven (runs 0.59-0.95,
    2026-12-07, main and 46d8511 alike), and one run alone failed a 0.15 band there. A regression that
    made the split cost more (a graph walk per parameter, say: W at 1.5 or more) still fails it."""
    from autopar.parallel.pipeline import stage_shares
    from bench.bench_pipeline import split_cost

    runs = [split_cost(sizes=((2, 32),), repeats=20)[0] for _ in range(5)]
    assert all(whole_ms > 0 for _, _, whole_ms, *_ in runs)
    b, w, first = (statistics.median(r[i] for r in runs) for i in (3, 4, 5))
    assert b == pytest.approx(stage_shares.SPLIT_B, abs=0.25)
    assert w == pytest.approx(stage_shares.SPLIT_W, abs=0.25)
    assert first == pytest.approx(stage_shares.FIRST_W, abs=0.25)


@pytest.mark.slow  # ~16 s on the loaded machine: 4 schedules x 5 steps; the split's shares above are its cheap sibling
def test_zero_bubble_span_prediction_against_measurement():
    """The cost model's step span of each zero-bubble schedule over 1F1B's (step_shares on the plan's
    stages, B and W at their measured shares) against the span replayed from the runners' measured
    CPU times on 2 simulated ranks, m = 4: within 10% (measured: ZB-H1 0.939 and 1.002 against
    0.941 predicted, ZBV 0.953 and 0.932 against 0.909, DualPipeV 0.966 and 0.950 against 0.908)."""
    from bench.bench_pipeline import simulated_spans

    for kind, (measured, predicted) in simulated_spans(p=2, m=4).items():
        assert measured == pytest.approx(predicted, rel=0.10), kind
