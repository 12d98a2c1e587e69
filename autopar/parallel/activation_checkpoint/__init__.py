"""Activation checkpointing, one folder: ``ap.ActivationCheckpoint`` (technique.py), which blocks it
wraps and how their nodes become one checkpointed call (regions.py), and what it keeps in the cost
model's terms (memory.py). The region's run-time half (runtime/recompute.py, runtime/offload.py)
stays in runtime/: the RNG replay and the live-bytes counter below parallel/ read it.

Example:
    >>> from autopar.parallel.activation_checkpoint import ActivationCheckpoint
    >>> ActivationCheckpoint().mode
    'full'
"""

from autopar.parallel.activation_checkpoint.technique import ActivationCheckpoint

__all__ = ["ActivationCheckpoint"]
