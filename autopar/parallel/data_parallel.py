"""ap.DataParallel: how the data-parallel axis synchronises, as one frozen value.

``data_parallel=`` in ap.plan / ap.parallelize takes either the axis name (``"dp"``: every
option at its default) or a DataParallel naming the axis and the options:

- ``bucket_mb`` / ``bucket_max_params``: gradients are fused into flat buckets bounded by
  bytes and by count (grouped by dtype), one collective per bucket, launched during backward
  as soon as the bucket's last gradient is accumulated. As in DDP the first bucket is
  smaller (``first_bucket_mb``, 1 MB) so that communication starts early in backward.
- ``zero``: 0 (plain all-reduce, every rank steps everything), 1 (optimizer state sharded:
  gradients all-reduced, each rank steps only its 1/dp slice of every bucket and the slices
  are all-gathered) or 2 (gradients too: reduce-scattered, the non-owned gradient memory is
  freed). Stages 1 and 2 need ``ap.ZeroOptimizer`` (or ``plan.zero_optimizer``).
- ``local_sgd_every=k``: no gradient sync on the axis; each rank steps on its own gradient
  and parameters are averaged every k optimizer steps (``module.autopar_local_sgd``).
- ``reduce_dtype``: gradients are cast to this dtype for the collective and back after it.

Example:
    >>> dp = ap.DataParallel("dp", bucket_mb=4, zero=2, reduce_dtype=torch.bfloat16)
    >>> plan = ap.plan(model, ap.Mesh((4,), ("dp",)), args=(x,), data_parallel=dp)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import PlanError
from autopar.parallel.technique import Technique

DEFAULT_BUCKET_MB = 25.0      # DDP's bucket_cap_mb
DEFAULT_FIRST_BUCKET_MB = 1.0  # as DDP: a small first bucket starts communication early


class DataParallelError(PlanError):
    """DataParallel options that cannot work together (or a ZeRO/local-SGD module misused)."""


@dataclass(frozen=True)
class DataParallel(Technique):
    axis: str
    bucket_mb: float = DEFAULT_BUCKET_MB
    bucket_max_params: int | None = None
    zero: int = 0
    local_sgd_every: int | None = None
    reduce_dtype: torch.dtype | None = None
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB

    name = "data_parallel"

    def __post_init__(self):
        if not isinstance(self.axis, str):
            raise DataParallelError(f"DataParallel axis must be a mesh axis name, got {self.axis!r}.")
        if not (self.bucket_mb > 0 and self.first_bucket_mb > 0):
            raise DataParallelError(f"DataParallel(bucket_mb={self.bucket_mb}, first_bucket_mb={self.first_bucket_mb}) "
                                    "must be > 0 (DDP's defaults: 25 and 1).")
        if self.bucket_max_params is not None and self.bucket_max_params < 1:
            raise DataParallelError("DataParallel(bucket_max_params=...) must be None or >= 1.")
        if self.zero not in (0, 1, 2):
            raise DataParallelError(f"DataParallel(zero={self.zero!r}): use 0 (off), 1 (optimizer state "
                                    "sharded) or 2 (optimizer state and gradients sharded).")
        if self.local_sgd_every is not None and (not isinstance(self.local_sgd_every, int)
                                                 or self.local_sgd_every < 1):
            raise DataParallelError(f"DataParallel(local_sgd_every={self.local_sgd_every!r}) must be None "
                                    "or a positive number of optimizer steps.")
        if self.zero and self.local_sgd_every is not None:
            raise DataParallelError("DataParallel: zero and local_sgd_every exclude each other (local SGD "
                                    "steps every rank on its own full optimizer state); pick one.")
        if self.reduce_dtype is not None and not (isinstance(self.reduce_dtype, torch.dtype)
                                                  and self.reduce_dtype.is_floating_point):
            raise DataParallelError(f"DataParallel(reduce_dtype={self.reduce_dtype!r}) must be a floating "
                                    "torch dtype such as torch.bfloat16, or None.")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @property
    def first_bucket_bytes(self) -> int:
        return int(min(self.first_bucket_mb, self.bucket_mb) * 2**20)

    @classmethod
    def of(cls, value) -> "DataParallel | None":
        """Normalise ap.plan's ``data_parallel=``: None, an axis name, or a DataParallel."""
        if value is None or isinstance(value, DataParallel):
            return value
        if isinstance(value, str):
            return cls(value)
        raise DataParallelError(f"data_parallel={value!r}: give a mesh axis name ('dp') or "
                                "ap.DataParallel('dp', ...).")

    def __str__(self) -> str:
        parts = [repr(self.axis), f"bucket_mb={self.bucket_mb:g}"]
        if self.bucket_max_params is not None:
            parts.append(f"bucket_max_params={self.bucket_max_params}")
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.local_sgd_every is not None:
            parts.append(f"local_sgd_every={self.local_sgd_every}")
        if self.reduce_dtype is not None:
            parts.append(f"reduce_dtype={self.reduce_dtype}")
        if self.first_bucket_mb != DEFAULT_FIRST_BUCKET_MB:
            parts.append(f"first_bucket_mb={self.first_bucket_mb:g}")
        return f"DataParallel({', '.join(parts)})"

    # ------------------------------------------------------- the technique (technique.py)
    def validate(self, mesh, options, annotations: dict) -> None:
        mesh.axis_index(self.axis)

    def data_axis(self) -> str:
        return self.axis

    def attach(self, plan, module, rank: int) -> None:
        """Local SGD's parameter averaging (the gradient buckets are attached for every plan)."""
        if self.local_sgd_every is not None and hasattr(module, "autopar_grad_sync"):
            from autopar.parallel.local_sgd import LocalSGD
            module.autopar_local_sgd = LocalSGD(module.autopar_grad_sync, self.local_sgd_every)

    def bucket_comms(self, numel, dtype: torch.dtype, n) -> list[tuple]:
        """(kind, phase, bytes per rank) of one gradient bucket on this axis of size ``n``."""
        if self.local_sgd_every is not None:
            return []  # parameters averaged every k steps instead
        return bucket_sync(self.zero, n, numel * (self.reduce_dtype or dtype).itemsize, numel * dtype.itemsize)

    def fields(self) -> dict:
        out = super().fields()
        if out["reduce_dtype"] is not None:
            out["reduce_dtype"] = str(out["reduce_dtype"]).removeprefix("torch.")
        return out

    @classmethod
    def from_fields(cls, fields: dict) -> "DataParallel":
        fields = dict(fields)
        if fields.get("reduce_dtype") is not None:
            fields["reduce_dtype"] = getattr(torch, fields["reduce_dtype"])
        return cls(**fields)


def bucket_sync(zero: int, n, wire_bytes, param_bytes) -> list[tuple]:
    """(kind, phase, bytes per rank) of one bucket's sync on a data-parallel axis of size ``n``:
    ``wire_bytes`` of gradient on the wire, ``param_bytes`` of parameters (ZeRO all-gathers them
    after the step). The one definition the plan's collectives and the search's costs share."""
    from autopar.sharding.redistribute import ring_bytes
    sync = ("reduce_scatter", "grad sync", ring_bytes("reduce_scatter", wire_bytes, n)) if zero == 2 else \
        ("all_reduce", "grad sync", ring_bytes("all_reduce", wire_bytes, n))
    gather = [("all_gather", "optimizer", ring_bytes("all_gather", param_bytes / n, n))] if zero else []
    return [sync] + gather
