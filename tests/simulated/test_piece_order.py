"""Orders of pieces on a load-balanced context-parallel axis (sharding/piece_order.py, issue 52).

The user's sequences are cut zig-zag there, parameters plainly; each split value and each op's
input knows which, so the program joins, cuts and reorders them right. Against serial, forward
and gradients, where a layer or a parameter is split on the cp axis beside the sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.sharding.piece_order import piece_orders


class PositionTable(nn.Module):
    """Token embedding plus a learned (seq, d) position table added as a tensor, then a Linear."""

    def __init__(self, vocab=16, seq=8, d=6, out=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d))
        self.head = nn.Linear(d, out)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids) + self.pos))


def _plan(model, ids, annotations, n=2, method="ring"):
    mesh = ap.Mesh((n,), ("cp",))
    cp = ap.ContextParallel("cp", method=method, load_balance=True)
    return ap.plan(model, mesh, args=(ids,), annotations=annotations, context_parallel=cp)


@pytest.mark.parametrize("n", [2, 4])
def test_table_split_on_the_sequence_is_reordered_to_zigzag(n):
    torch.manual_seed(0)
    model, ids = PositionTable(), torch.randint(0, 16, (3, 8))
    plan = _plan(model, ids, {"pos": ap.place(ap.Shard(0))}, n)
    orders = piece_orders(plan)
    assert orders.axes == {0}
    pos = next(node for node in plan.graph.nodes if plan.attr_name(node.name) == "pos")
    assert not orders.zigzag_out(pos, 0)  # the stored piece is plain
    add = next(u for u in pos.users)
    assert [(name, axis) for name, _, axis in orders.reorders] == [(add.name, 0)]  # reordered where it meets
    plan.check(ids)


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_colwise_on_the_cp_axis_joins_its_output_plainly(method):
    torch.manual_seed(1)
    model, ids = PositionTable(out=8), torch.randint(0, 16, (2, 8))
    plan = _plan(model, ids, {"head": ap.colwise("cp")}, 2, method)
    head = next(n for n in plan.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert not piece_orders(plan).zigzag_out(head, 0)  # split by the weight's rows
    assert not piece_orders(plan).reorders
    plan.check(ids)


def test_vocab_embedding_on_the_cp_axis_reads_plain_rows():
    torch.manual_seed(2)
    model, ids = PositionTable(), torch.randint(0, 16, (2, 8))
    plan = _plan(model, ids, {"embed": ap.rowwise("cp")}, 2, "allgather")
    plan.module(0)  # emitted: the lowering reads its rows as one range
    plan.check(ids)


def test_no_zigzag_axis_no_orders():
    model, ids = PositionTable(), torch.randint(0, 16, (2, 8))
    plan = ap.plan(model, ap.Mesh((2,), ("cp",)), args=(ids,), context_parallel="cp")
    assert piece_orders(plan).axes == frozenset() and not piece_orders(plan).plain_out


def test_reorders_are_counted_and_described():
    model, ids = PositionTable(), torch.randint(0, 16, (3, 8))
    plan = _plan(model, ids, {"pos": ap.place(ap.Shard(0))}, 2)
    moved = [c for c in plan.collectives() if "reordered" in c.reason]
    assert [c.phase for c in moved] == ["forward", "backward"]
    assert moved[0].bytes == 8 * 6 * 4 / 2  # the rank's half of the (8, 6) fp32 table, sent once
    assert "reordered to zig-zag" in str(plan)


class NoisyPositionTable(PositionTable):
    """The position-table model with dropout after the sum (a training loop's randomness)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.drop = nn.Dropout(0.25)

    def forward(self, ids):
        return self.head(self.drop(torch.tanh(self.embed(ids) + self.pos)))


def test_reordered_plan_on_a_3_axis_mesh_in_a_training_loop():
    """The reorder on the paths users take: dp x cp x tp with head features that do not divide by tp,
    dropout with serial draws, eval and no_grad, clipping, compiled, and the checkpoint's boxes."""
    from fuzz.clip_mode import check_clipping
    from fuzz.modes import compare_with_serial
    from fuzz.user_modes import check_state_dict

    torch.manual_seed(3)
    model, ids = NoisyPositionTable(out=5), torch.randint(0, 16, (4, 8))
    mesh = ap.Mesh((2, 2, 2), ("dp", "cp", "tp"))
    cp = ap.ContextParallel("cp", method="ring", load_balance=True)
    annotations = {"pos": ap.place(ap.Replicate(), ap.Shard(0), ap.Replicate()), "head": ap.colwise("tp")}
    plan = ap.plan(
        model, mesh, args=(ids,), annotations=annotations, context_parallel=cp, data_parallel="dp", rng="serial"
    )
    assert piece_orders(plan).reorders  # the table meets the sequence
    compare_with_serial(plan, (ids,), seed=5, calls=2)  # dropout, gradients accumulated
    compare_with_serial(plan, (ids,), train=False, ctx=torch.no_grad)
    check_clipping(plan, (ids,))
    check_state_dict(None, plan, (ids,))
    compare_with_serial(plan, (ids,), wrap=lambda m: torch.compile(m, backend="aot_eager"), seed=5)
