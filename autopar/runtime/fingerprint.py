"""Every ap.parallelize: ranks compare a cheap fingerprint of their plans before any collective.

Ranks that planned differently (another model config, annotation, mesh or option on one
rank) would pair unrelated collectives: on gloo a broadcast of differently shaped tensors
kills the rank whose buffer is too small (SIGABRT from gloo's EnforceNotMet) while the other
waits for its timeout. So before making any process group or moving any tensor, every rank
sends a small fingerprint of its plan to every other (one ``all_gather_object`` on the world
group, which pads pickles of different lengths) and all of them compare the same list: every
rank raises the same InconsistentPlanError, naming what differs and which ranks hold what,
and none aborts. With ``debug=True`` the fingerprint also lists every collective of the rank's
module, in order with its group, and a difference names the first collective that differs
(consistency.py).

The fingerprint, in the order differences are reported: the mesh, the model's class, the plan
options (not the dropout seed, which parallelize broadcasts), every parameter's and buffer's
global shape and dtype, and consistency.plan_hash (every node's layout and strategy).

Example:
    >>> exchange_fingerprints(plan, timeout=60.0)   # ap.parallelize does this on every rank
    autopar.errors.InconsistentPlanError: ranks planned differently (found before any collective):
    parameter 'fc1.weight': rank 0 has (32, 8) float32, rank 1 has (64, 8) float32. ...
"""

from __future__ import annotations

import dataclasses

from autopar.errors import InconsistentPlanError
from autopar.runtime.consistency import collective_sequence, compare, plan_hash
from autopar.runtime.failures import explain

FIELDS = ("mesh", "model", "options", "tensors", "graph")


def fingerprint(plan) -> dict:
    """What must be equal on every rank of a job, readable where a difference is reported."""
    options = dataclasses.replace(plan.options, seed=0, debug=False)
    named = list(plan.model_tensors["params"].items()) + list(plan.model_tensors["buffers"].items())
    return {
        "mesh": f"{tuple(plan.mesh.shape)} {tuple(plan.mesh.axis_names)}",
        "model": type(plan.model).__name__,
        "options": repr(options),
        "tensors": [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named],
        "graph": plan_hash(plan),
    }


def exchange_fingerprints(plan, timeout: float | None = None, module=None) -> None:
    """Gather every rank's fingerprint and compare (all ranks, same answer: all raise or none).
    With ``module`` (debug=True) the fingerprint holds its collectives in order too.

    On gloo a monitored barrier comes first (with debug, or given a ``timeout``), so that a
    rank that never gets here (it failed while planning) is named within ``timeout`` seconds
    (debug: 300 by default) instead of the exchange waiting for the world group's own timeout."""
    import datetime
    import time

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return
    if dist.get_backend() == "gloo" and (timeout is not None or module is not None):
        start = time.monotonic()
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout or 300), wait_all_ranks=True)
        except RuntimeError as e:
            raise explain(
                "monitored_barrier (plan fingerprint)", range(world), rank, timeout, e, time.monotonic() - start
            ) from e
    mine = fingerprint(plan)
    if module is not None:
        mine["collectives"] = collective_sequence(module)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    compare_fingerprints(gathered)


def compare_fingerprints(prints: list[dict]) -> None:
    """Raise InconsistentPlanError naming the first field that differs between ranks."""
    for field in FIELDS:
        if field == "graph" and "collectives" in prints[0]:  # debug: the plans and every collective
            compare([(p["graph"], p["collectives"]) for p in prints])
            continue
        values = [p[field] for p in prints]
        if all(v == values[0] for v in values):
            continue
        what = _tensor_difference(values) if field == "tensors" else _who_has(field, values)
        raise InconsistentPlanError(
            f"ranks planned differently (found before any collective): {what}. Every rank must call "
            "ap.parallelize with the same model (architecture and config), annotations, mesh and "
            "options; ap.parallelize(..., debug=True) also compares every collective's order."
        )


def _who_has(field: str, values: list) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(str(v) if field != "graph" else f"plan {v}", []).append(r)
    shown = "; ".join(f"ranks {rs} have {v[:300]}" for v, rs in groups.items())
    return f"the {field} differs: {shown}"


def _tensor_difference(values: list) -> str:
    """The first parameter or buffer whose name, shape or dtype differs, rank by rank."""
    longest = max(len(v) for v in values)
    for i in range(longest):
        entries = [v[i] if i < len(v) else None for v in values]
        if any(e != entries[0] for e in entries):
            name = next(e[0] for e in entries if e is not None)
            held = ", ".join(
                f"rank {r} has " + ("nothing" if e is None else f"{e[0]!r} {e[1]} {e[2]}")
                for r, e in enumerate(entries)
            )
            return f"parameter or buffer #{i} ({name!r}): {held}"
    return "the parameters and buffers differ"
