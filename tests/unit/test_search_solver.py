"""The search's solver: costing every combination (numpy) gives the MILP's optimum and tie-breaks."""

from __future__ import annotations

import random

import pytest

from autopar.search.solver import Option, solve
from autopar.search.weigh import least_memory


def _options(rng: random.Random, n_options: int, n_comps: int, ties: bool, moments: int = 1) -> list[Option]:
    """Random options; ``moments`` memory coefficients each (a step's phases: the solver holds each
    to the budget and the largest is the memory)."""

    def coef():
        if ties:  # few distinct values: many options cost the same
            mem = tuple(rng.choice([1.0, 3.0]) for _ in range(moments))
            return (rng.choice([1.0, 2.0]), rng.choice([0.0, 0.5]), rng.choice([0.0, 1.0]), *mem)
        return (rng.uniform(0, 2), rng.uniform(0, 1), rng.uniform(0, 1), *(rng.uniform(0, 4) for _ in range(moments)))

    out = []
    for g in range(n_options):
        comps = {f"c{c}": {"split": coef(), "R": coef()} for c in range(n_comps)}
        # every other option needs a wrapped optimizer (ZeRO-1/2): the tie-break between idle axes and memory
        out.append(
            Option(("opt", g), coef(), comps, idle=rng.choice([0, 0, 1]), idle_choice={"R": 0.25}, wrapped=g % 2)
        )
    return out


@pytest.mark.parametrize("moments", [1, 4])
@pytest.mark.parametrize("seed", range(12))
def test_enumeration_equals_milp(seed, moments):
    rng = random.Random(seed)
    options = _options(rng, rng.randint(1, 6), rng.randint(0, 3), ties=seed % 2 == 0, moments=moments)
    for budget in (None, 6.0, 9.0, 0.5):
        overlap = rng.choice([0.0, 1.0])
        fast = solve(options, budget, overlap)
        slow = solve(options, budget, overlap, milp_only=True)
        if slow is None:
            assert fast is None
            continue
        assert fast.time == pytest.approx(slow.time, rel=1e-9, abs=1e-12)
        assert fast.memory == pytest.approx(slow.memory, rel=1e-9, abs=1e-9)
        if seed % 2 == 0:  # ties: the same tie-break (fewest idle axes, then least memory)
            assert (fast.option, fast.choices) == (slow.option, slow.choices) or (
                fast.memory == pytest.approx(slow.memory)
            )


@pytest.mark.parametrize("milp_only", [False, True])
def test_ties_go_to_a_plain_optimizer_unless_the_budget_needs_zero(milp_only):
    """ZeRO-2 (wrapped: a plain torch.optim optimizer cannot step it) ties ZeRO-0 in time and keeps
    less: without a budget the plain option wins the tie (the user's loop keeps working); a budget
    only ZeRO-2 meets takes it; one idle axis still outweighs a wrapped optimizer."""
    plain = Option("zero=0", (1.0, 0.0, 0.0, 8.0), {})
    zero2 = Option("zero=2", (1.0, 0.0, 0.0, 5.0), {}, wrapped=1)
    idle = Option("idle, zero=0", (1.0, 0.0, 0.0, 8.0), {}, idle=1)
    assert solve([zero2, plain], None, 0.0, milp_only=milp_only).option == "zero=0"
    assert solve([zero2, plain], 6.0, 0.0, milp_only=milp_only).option == "zero=2"
    assert solve([zero2, idle], None, 0.0, milp_only=milp_only).option == "zero=2"


@pytest.mark.parametrize("moments", [1, 4])
@pytest.mark.parametrize("seed", range(8))
def test_small_options_costed_in_python_as_numpy(seed, moments, monkeypatch):
    # the search's one-option solves go through the Python rows (solver.SMALL): the same floats,
    # the same choice and tie-break as the numpy rows, with and without a budget
    import autopar.search.solver as solver

    rng = random.Random(seed)
    options = _options(rng, rng.randint(1, 6), rng.randint(0, 4), ties=seed % 2 == 0, moments=moments)
    for budget in (None, 6.0, 9.0, 0.5):
        overlap = rng.choice([0.0, 0.5, 1.0])
        got = [solve(options, budget, overlap)] + [solve([o], budget, overlap) for o in options]
        monkeypatch.setattr(solver, "SMALL", 0)
        want = [solve(options, budget, overlap)] + [solve([o], budget, overlap) for o in options]
        monkeypatch.undo()
        assert got == want


@pytest.mark.parametrize("milp_only", [False, True])
def test_memory_is_the_largest_moment_not_the_sum(milp_only):
    """A step's parts peak at different moments (the loss's backward holds activations and no
    gradient, the optimizer step gradients and no activation): an option is held to the budget at
    each moment, and its memory is the largest. Here a component's split choice moves bytes from
    one moment to the other; the sum of the moments (the parts' sum) would refuse both options."""
    fast = Option(
        "fast",
        (1.0, 0.0, 0.0, 4.0, 1.0),
        {"head": {"split": (0.0, 0.0, 0.0, 2.0, 0.5), "R": (0.5, 0.0, 0.0, 3.0, 0.5)}},
    )
    slow = Option("slow", (3.0, 0.0, 0.0, 2.0, 2.0), {})
    got = solve([fast, slow], 6.0, 0.0, milp_only=milp_only)
    assert (got.option, got.choices, got.memory, got.row) == ("fast", {"head": "split"}, 6.0, 0)
    got = solve([fast, slow], 5.0, 0.0, milp_only=milp_only)  # neither choice of "fast" fits its first moment
    assert (got.option, got.memory) == ("slow", 2.0)
    assert least_memory(fast) == 6.0 and least_memory(slow) == 2.0
