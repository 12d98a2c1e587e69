"""The bytes a pipeline rank holds between its actions, measured (LiveBytes) for the memory model's
tests (tests/simulated/test_pipeline_memory.py, tests/gloo/jobs_activation_checkpoint.py).

Example:
    >>> held = held_between_actions(plan.pipeline_runner(rank), batch)   # one figure per action
    >>> max(held), plan.memory_per_rank(rank)["activations"]
"""

from __future__ import annotations

from autopar.runtime.live_bytes import LiveBytes


def held_between_actions(runner, batch) -> list[int]:
    """After a warm-up step (gradients allocated), one step's bytes alive after each action but the
    last, among those the step made: read as the runner starts the next action (its sends let go
    of, the next action's receives posted), as the model's ``activations`` counts them."""
    runner.step(batch)
    prefetch, held = runner._prefetch, []
    with LiveBytes() as mem:

        def counted(actions):
            held.append(mem.refresh().live)
            prefetch(actions)

        runner._prefetch = counted
        try:
            runner.step(batch)
        finally:
            runner._prefetch = prefetch
    return held[1:]  # the first is before any action
