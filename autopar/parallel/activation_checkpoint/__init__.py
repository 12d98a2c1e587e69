"""Activation checkpointing, one folder: ``ap.ActivationCheckpoint`` (technique.py), which blocks it
wraps and how their nodes become one checkpointed call (regions.py), and what it keeps in the cost
model's terms (memory.py), and the region's run-time half: recompute.py (the checkpointed region
that runs and reruns; the generator replay it runs is runtime/rng.replayed_state) and offload.py
(host copies of what a region keeps, registered with runtime/live_bytes.register_host so that the
live-bytes counter tells them from device bytes).

Example:
    >>> from autopar.parallel.activation_checkpoint import ActivationCheckpoint
    >>> ActivationCheckpoint().mode
    'full'
"""

from autopar.parallel.activation_checkpoint.technique import ActivationCheckpoint

__all__ = ["ActivationCheckpoint"]
