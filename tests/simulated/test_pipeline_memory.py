"""A pipeline rank's activation memory: the model (parallel/pipeline/stage_memory.py) against the
bytes each simulated rank holds between its actions (LiveBytes), and the sends a rank lets go of
(parallel/pipeline/messages.py). The same on 4 gloo ranks: tests/gloo/test_activation_checkpoint.py."""

from __future__ import annotations

import pytest

import autopar as ap
from autopar.parallel.pipeline import messages, schedules
from autopar.parallel.pipeline.schedules import Action
from autopar.runtime.simulator import run_ranks
from tests.harness.models import gpt_batch, small_gpt
from tests.harness.pipeline_memory import held_between_actions


def _plan(schedule, checkpoint, chunks=1, microbatches=4, batch=8):
    pipe = ap.Pipeline("pp", microbatches=microbatches, schedule=schedule, checkpoint=checkpoint, chunks=chunks)
    data = gpt_batch(batch=batch, seq=16)
    return ap.plan(small_gpt(layers=4 * chunks), ap.Mesh((4,), ("pp",)), args=data, pipeline=pipe), data


def _held(plan, batch) -> list[int]:
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    return run_ranks(plan.mesh.size, lambda r: max(held_between_actions(runners[r], batch)), timeout=60)


@pytest.mark.parametrize(
    "schedule,checkpoint,chunks,m",
    [("1f1b", False, 1, 4), ("1f1b", True, 1, 4), ("gpipe", False, 1, 4), ("gpipe", True, 1, 4),
     ("interleaved", False, 2, 8), ("interleaved", True, 2, 8), ("zb-h1", False, 1, 4), ("zb-h1", True, 1, 4),
     ("zbv", False, 2, 4), ("zbv", True, 2, 4), ("dualpipev", False, 2, 8), ("dualpipev", True, 2, 8)],
)  # fmt: skip
def test_memory_per_rank_is_what_each_rank_holds(schedule, checkpoint, chunks, m):
    """memory_per_rank(rank)["activations"] within 15% of the most bytes the rank holds between
    its actions: its micro-batches in flight (whole stages, or their inputs and sends under
    checkpoint=True), its sends until they are known received, its prefetched receives
    (interleaved: m = 2 pp, so that its steady 1F1B part runs)."""
    plan, batch = _plan(schedule, checkpoint, chunks, microbatches=m, batch=2 * m)
    held = _held(plan, batch)
    model = [plan.memory_per_rank(r)["activations"] for r in plan.mesh.ranks()]
    for rank, (h, m) in enumerate(zip(held, model)):
        assert abs(m / h - 1) < 0.15, (rank, h, m)
    peak = plan.peak_memory_rank()  # plan.cost() answers for the rank that holds the most in all
    assert plan.cost().at()["memory"]["activations"] == pytest.approx(model[peak])


def test_one_f_one_b_holds_no_more_with_more_micro_batches():
    """1F1B keeps pp - r micro-batches in flight whatever the micro-batch count: twice the
    micro-batches of the same size hold the same (sends kept to the step's end grew with m:
    rank 0 held 8 sent activations at m=8, 16 at m=16)."""
    small, big = _plan("1f1b", True, microbatches=8, batch=16), _plan("1f1b", True, microbatches=16, batch=32)
    held_small, held_big = _held(*small), _held(*big)
    assert held_big == pytest.approx(held_small, abs=64)  # the last stage keeps each loss: 4 bytes
    for rank in range(4):
        assert small[0].memory_per_rank(rank)["activations"] == big[0].memory_per_rank(rank)["activations"]


@pytest.mark.parametrize("schedule,chunks,m", [("1f1b", 1, 4), ("gpipe", 1, 4), ("interleaved", 2, 8)])
def test_a_send_is_let_go_once_its_receiver_answered(schedule, chunks, m):
    """Every release happens after an action that heard from the receiver after the receiver
    consumed the message (so the runner's wait on the send returns at once)."""
    plan, _ = _plan(schedule, False, chunks, microbatches=m, batch=2 * m)
    lay = plan.stage_layout
    built = schedules.build(schedule, lay.pp, m, chunks)
    for pos in range(lay.pp):
        acts, got = built[pos], messages.releases(lay, built, pos)
        where = {a: i for i, a in enumerate(acts)}
        for i, found in got.items():
            for m in found:
                sender = where[messages.sender_action(m)]
                assert sender < i
                # the action that let it go heard from the receiver after the receiver consumed it
                q = lay.rank_of_stage(m.dst)
                consumed = built[q].index(messages.consumer_action(m))
                heard = [built[q].index(messages.sender_action(r)) for r in messages.received(lay, acts[i])
                         if lay.rank_of_stage(r.src) == q]  # fmt: skip
                assert any(at >= consumed for at in heard), (pos, i, m)
        # a value that gets a gradient back is always let go before the step's end (at the latest
        # by the backward that receives that gradient)
        let_go = {m: i for i, ms in got.items() for m in ms}
        for i, a in enumerate(acts):
            for m in messages.sent(lay, a):
                if m.direction == 0 and lay.kinds[m.value] == "grad" and lay.rank_of_stage(m.dst) != pos:
                    back = where[Action("B", m.microbatch, m.producer)]
                    assert let_go.get(m, len(acts)) <= back, (pos, m)
    if schedule != "1f1b":
        return
    # rank 0's sends to stage 1 (micro-batch 0's boundary values) are let go at its first
    # backward, B0, which receives the gradient stage 1 sent after it consumed them; its sizes
    # sent to stages 2 and 3 (ints: no gradient comes back, nothing later from them) at the end
    first = built[0]
    forward = messages.sent(lay, Action("F", 0, 0))
    released = {m: i for i, ms in messages.releases(lay, built, 0).items() for m in ms}
    to_next = [m for m in forward if m.dst == 1]
    assert to_next and all(first[released[m]] == Action("B", 0, 0) for m in to_next)
    assert all(m not in released for m in forward if m.dst > 1)


def test_zero3_stages_accumulate_whole_gradient_flats(monkeypatch):
    """zero=3 under 1F1B: a stage's gathers reduce once a step, in the last micro-batch's backward;
    the earlier ones keep each bucket's unreduced flat (fp32: reduce_dtype). The model's
    ``accumulated`` is the most those flats hold on each rank, measured in the runtime, less
    the rank's gradient pieces of them (the phase rows add ``grads`` beside it: the flats
    stand for them until the last reduce; fp32 here as the flats, 1/2 of them on dp 2); the
    one-micro-batch terms (a checkpointed block's recompute, the loss's backward) are 1/m of
    the whole batch's; and ap.predict counts the flats (its ``memory`` beside the plan's)."""
    import torch

    from autopar.cost.formulas import Numbers
    from autopar.cost.plan_cost import activation_terms
    from autopar.parallel.data_parallel.fsdp_runtime import FSDPRuntime
    from autopar.search.evaluate import Terms, plan_terms

    most: dict = {}
    reduce = FSDPRuntime.reduce

    def counting(self, k, grads):
        out = reduce(self, k, grads)
        held = sum(f.numel() * f.element_size() for f in self.acc.values())
        most[self.rank] = max(most.get(self.rank, 0), held)
        return out

    monkeypatch.setattr(FSDPRuntime, "reduce", counting)
    data = gpt_batch(batch=8, seq=16)
    dp = ap.DataParallel("dp", zero=3, reduce_dtype=torch.float32)
    plan = ap.plan(small_gpt(layers=4), ap.Mesh((2, 2), ("dp", "pp")), args=data, data_parallel=dp,
                   pipeline=ap.Pipeline("pp", microbatches=2), activation_checkpoint=ap.ActivationCheckpoint("full"))  # fmt: skip
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    run_ranks(plan.mesh.size, lambda r: float(runners[r].step(data)), timeout=60)
    whole = activation_terms(plan, Numbers(plan.mesh), whole_model=True)
    for rank in plan.mesh.ranks():
        mem = plan.memory_per_rank(rank)
        assert mem["accumulated"] == most[rank] // 2 > 0, (rank, mem["accumulated"], most)
        last = plan.mesh.coords(rank)[plan.stage_layout.axis] == 1
        if last:  # the model's last block and the head: the whole model's recompute, one micro-batch
            assert mem["recompute"] == pytest.approx(whole["recompute"] / 2, rel=0.05)
        else:  # the first blocks', none of the head's kept tensors freed before them: more
            assert mem["recompute"] > whole["recompute"] / 2
    assert plan.memory_per_rank(2)["backward"] == pytest.approx(whole["backward"] / 2, rel=0.05)  # last stage
    # ap.predict (the search's terms, a pipeline rank's share): the flats of the plan's buckets
    prof = ap.Auto(device="h100").profile()
    terms = Terms()
    for t in plan_terms(plan, {}, prof).values():
        terms.add(t)
    rank = terms.scaled(plan.options.pipeline.step_shares(plan.mesh, plan.stage_layout), plan.mesh, prof)
    transient = lambda t: t.recompute + t.workspace + t.loss_backward  # noqa: E731 - one micro-batch's
    assert rank.pieces == 2 and transient(rank) == pytest.approx(transient(terms) / 2)
    with_flats = rank.memory(plan.mesh, plan.dp_axis, dp, plan)
    assert with_flats == pytest.approx(ap.predict(plan, prof)["memory_estimate"])
    assert rank.memory_parts(plan.mesh, plan.dp_axis, dp, plan)["accumulated"] == most[0] // 2
    rank.pieces = 1  # one backward pass: nothing accumulates
    assert rank.memory_parts(plan.mesh, plan.dp_axis, dp, plan)["accumulated"] == 0
    zero2 = plan.with_options(plan.options.replace(data_parallel=ap.DataParallel("dp", zero=2)))
    for rank in plan.mesh.ranks():  # ZeRO-2 keeps 1/2 of its gradients, but whole while they accumulate
        mem = zero2.memory_per_rank(rank)
        assert mem["accumulated"] == mem["grads"] > 0
