"""Errors about the user's input. Every one names what is wrong and how to fix it.

Example:
    >>> try:
    ...     ap.Mesh((2, 2), ("dp",))
    ... except ap.PlanError as e:
    ...     print(e)
"""

from __future__ import annotations

import difflib


class PlanError(Exception):
    """Base of every error about the user's input (model, mesh, annotations, inputs)."""


class MeshError(PlanError):
    """The mesh is malformed, an axis is unknown, or it does not match the world."""


class AnnotationError(PlanError):
    """An annotation matches nothing, conflicts with another, or cannot apply."""


class TraceError(PlanError):
    """The model could not be traced by torch.export."""


class ShardingError(PlanError):
    """A tensor cannot be laid out as asked (indivisible dim, axis used twice, ...)."""


class NoRuleError(PlanError):
    """An ATen op has no sharding rule and one of its inputs is sharded."""


class InputError(PlanError):
    """Inputs given to a plan or a rank's module do not match what was planned."""


class InconsistentPlanError(PlanError):
    """Ranks of one job planned differently (found by ap.parallelize(..., debug=True))."""


class DataParallelError(PlanError):
    """DataParallel options that cannot work together (or a ZeRO/local-SGD module misused)."""


class PipelineError(PlanError):
    """A pipeline option, stage split or schedule that cannot work."""


class FaultToleranceError(PlanError):
    """Fault tolerance (ap.FaultTolerant) asked of a plan it cannot protect, or its lighthouse or
    quorum failing at run time."""


class CheckpointError(PlanError):
    """A state dict or checkpoint that does not fit the module it is loaded into."""


class PlanMismatch(AssertionError):
    """Raised by Plan.check: a rank's result differs from the serial model's."""


def close_matches(word: str, candidates, n: int = 5) -> str:
    """A short 'did you mean' phrase listing the candidates closest to ``word``."""
    candidates = sorted(set(candidates))
    best = difflib.get_close_matches(word, candidates, n=n, cutoff=0.4)
    if not best:
        best = candidates[:n]
    return ", ".join(repr(b) for b in best) if best else "(none)"
