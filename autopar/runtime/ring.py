"""Bytes and message rounds of ring collectives: the one formula every byte count in autopar uses.

The plan's collectives, the cost model, the search, ``ap.comm_stats()`` and the redistribution
planner all count with these, so a figure shown in one place is the figure of every other.
Both work on numbers and on sympy expressions alike.

Example:
    >>> ring_bytes("all_reduce", 8.0, 4), ring_bytes("all_gather", 8.0, 4)
    (12.0, 24.0)
    >>> ring_steps("all_reduce", 4)
    6
"""

from __future__ import annotations

# a bucketed collective's size: the gradient sync fuses gradients into flats of this many MB (DDP's
# bucket_cap_mb), one collective each; the cost model counts a sync's latency rounds per bucket
DEFAULT_BUCKET_MB = 25.0

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "ring_shift", "ring_pass")


def ring_bytes(kind: str, local_bytes, n):
    """Bytes each rank sends for collective ``kind`` whose input holds ``local_bytes`` on each
    rank: all_gather (n-1) x input; all_reduce 2(n-1)/n x input; reduce_scatter and all_to_all
    (n-1)/n x input; ring_shift (each rank sends its tensor to the next rank of the ring: one
    step of ring attention) 1 x input; ring_pass (n - 1 shifts: every rank's tensor visits every
    rank, ring attention's K/V) (n-1) x input."""
    if n == 1:
        return 0.0
    if kind == "ring_shift":
        return local_bytes
    if kind == "ring_pass":
        return (n - 1) * local_bytes
    if kind == "all_gather":
        return (n - 1) * local_bytes
    if kind == "all_reduce":
        return 2 * (n - 1) / n * local_bytes
    return (n - 1) / n * local_bytes


def ring_steps(kind: str, n):
    """Latency terms (message rounds) of a ring collective over ``n`` ranks."""
    if kind == "ring_shift":  # (n == 1 tests a symbol structurally: a formula's axis counts one round)
        return 0 if n == 1 else 1
    if kind == "ring_pass":
        return n - 1
    return 2 * (n - 1) if kind == "all_reduce" else (n - 1)
