"""Pipeline schedules as data (no torch): completeness, placement, deadlock, memory, bubble."""

from __future__ import annotations

import pytest

from autopar.parallel.pipeline import PipelineError, schedules as S

GRID = [
    (kind, p, m, v)
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
    for p in (2, 4)
    for m in (4, 8, 12)
    if kind != "interleaved" or m % p == 0
]


@pytest.mark.parametrize("kind,p,m,v", GRID)
def test_every_action_once_on_its_rank_without_deadlock(kind, p, m, v):
    sched = S.build(kind, p, m, v)
    n = p * v
    for r, acts in enumerate(sched):
        assert all(a.stage % p == r for a in acts)
        assert sorted((a.kind, a.microbatch, a.stage) for a in acts) == sorted(
            (k, i, s) for k in "FB" for i in range(m) for s in range(r, n, p)
        )
    slots = S.replay(sched, n)  # raises on deadlock
    assert S.idle_fraction(slots) == pytest.approx([S.theoretical_bubble(kind, p, m, v)] * p)
    # uneven forward/backward costs keep the bubble of GPipe and 1F1B
    if kind != "interleaved":
        uneven = S.replay(sched, n, lambda a: 1.0 if a.kind == "F" else 2.0)
        assert S.idle_fraction(uneven) == pytest.approx([(p - 1) / (m + p - 1)] * p)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3)])
def test_in_flight_counts(p, m):
    assert [S.max_in_flight(a) for a in S.build("1f1b", p, m)] == [min(p - r, m) for r in range(p)]
    assert [S.max_in_flight(a) for a in S.build("gpipe", p, m)] == [m] * p


def test_forward_only_and_table():
    fwd = S.build("1f1b", 2, 3, forward_only=True)
    assert all(a.kind == "F" for acts in fwd for a in acts)
    S.replay(fwd, 2)
    text = S.table(S.replay(S.build("gpipe", 2, 2), 2))
    assert text.splitlines()[1].split()[2:] == ["F0", "F1", ".", ".", "B0", "B1"]


def test_deadlock_is_reported():
    bad = [[S.Action("B", 0, 0), S.Action("F", 0, 0)], [S.Action("F", 0, 1), S.Action("B", 0, 1)]]
    with pytest.raises(PipelineError, match="deadlocks"):
        S.replay(bad, 2)
