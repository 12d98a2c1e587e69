"""ap.clip_grad_norm_: the serial model's gradient norm on every rank, and the same clipping.

``torch.nn.utils.clip_grad_norm_`` on a rank's module sees only that rank's pieces: a
tensor-parallel weight contributes its shard, a replicated parameter counts once per rank
that holds it, ZeRO-2 keeps only a slice of each gradient, a pipeline stage sees its own
stage. Each rank then computes a different norm and clips by a different factor, and the
replicas drift apart. Here each rank sums ``|g|^p`` over the gradient pieces it is the
*counting holder* of, and the sums are added over every mesh axis (an all-gather, summed in
rank order, so every rank gets the bit-identical total):

- a piece is counted by one rank of each axis it is not split on (coordinate 0), so a
  replicated tensor counts once and a split one once per distinct piece;
- under ZeRO-2 a parameter's gradient lives as this rank's slice of the dp-reduced bucket:
  the slices are disjoint over dp, so each counts there (other axes as above);
- under ZeRO-3 (and HSDP) a parameter is stored as disjoint pieces over dp (technique.stored_axes),
  each counted where it is stored (once per replica group: technique.counts_stored);
- in a pipeline, each stage's parameters live only on that stage's ranks: the pp axis adds
  the stages; a weight tied across stages (its gradient summed over them) counts on the
  first holder only;
- ``norm_type=inf`` takes the maximum instead of the sum.

Every rank then multiplies every gradient it holds (``.grad`` and ZeRO's slices) by the same
``min(1, max_norm / (total + 1e-6))``, as torch does. Call it after the synced backward (not
inside ``no_sync()``: gradients are still partial there) and before the optimizer step.

Example:
    >>> loss.backward()
    >>> total = ap.clip_grad_norm_(module, max_norm=1.0)   # module: plan.module(r), ap.parallelize(...),
    >>> opt.step()                                         # or a plan.pipeline_runner(r)
"""

from __future__ import annotations

import math
import torch

from autopar.runtime.backend import current_backend
from autopar.errors import PlanError


class ClipError(PlanError):
    """clip_grad_norm_ cannot compute the serial norm for this module or at this moment."""


def clip_grad_norm_(
    module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> torch.Tensor:
    """Clip every rank's gradients by the serial model's total norm; return that norm.

    ``module``: a rank's module (``plan.module(rank)``, ``ap.parallelize(...)``) or a pipeline
    runner (``plan.pipeline_runner(rank)``). Same arguments and result as
    ``torch.nn.utils.clip_grad_norm_``; the result is the same tensor value on every rank.
    """
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ClipError(f"clip_grad_norm_: norm_type {norm_type} is not supported; use a p > 0 or inf.")
    pieces, mesh, rank = _pieces(module)
    counted = [g for g, count in pieces if count]
    dtype = counted[0].dtype if counted else torch.float32
    local = _local_total(counted, norm_type)
    total = _over_mesh(local, mesh, rank, norm_type)
    total = (total if norm_type == math.inf else total ** (1.0 / norm_type)).to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale([g for g, _ in pieces], coef, foreach)
    return total


def _local_total(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """This rank's share: sum of |g|^p (or max |g|) over the pieces it counts, in float64."""
    out = torch.zeros((), dtype=torch.float64)
    for g in grads:
        g = g.detach().double()
        if norm_type == math.inf:
            out = torch.maximum(out, g.abs().max() if g.numel() else out)
        else:
            out = out + torch.linalg.vector_norm(g, norm_type) ** norm_type
    return out


def _over_mesh(local: torch.Tensor, mesh, rank: int, norm_type: float) -> torch.Tensor:
    """Combine every rank's share, one mesh axis at a time (gathered, added in group order)."""
    backend, total = None, local.reshape(1)
    for axis in range(mesh.ndim):
        if mesh.shape[axis] == 1:
            continue
        backend = backend or current_backend()
        parts = backend.all_gather(total, 0, tuple(mesh.group(axis, rank)), rank)
        total = parts.max().reshape(1) if norm_type == math.inf else _ordered_sum(parts)
    return total[0]


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    out = parts[0].clone()
    for p in parts[1:]:
        out = out + p
    return out.reshape(1)


def _scale(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    if not grads:
        return
    with torch.no_grad():
        if foreach is not False:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        else:
            for g in grads:
                g.mul_(coef.to(g.dtype))


# ------------------------------------------------------------------------- which pieces
def _pieces(module) -> tuple[list[tuple[torch.Tensor, bool]], object, int]:
    """(gradient tensor, counted by this rank) for every gradient this rank holds, from the rank
    protocol every rank module and pipeline runner has (codegen/rank_module.py)."""
    grad_pieces = getattr(module, "autopar_grad_pieces", None)
    if grad_pieces is None:
        raise ClipError(
            "clip_grad_norm_ needs a rank's module from plan.module(rank), plan.build_module, "
            "ap.parallelize or plan.pipeline_runner; for a plain nn.Module use "
            "torch.nn.utils.clip_grad_norm_."
        )
    _refuse_unsynced(getattr(module, "autopar_grad_sync", None))
    pieces = [(g, counted) for _, g, counted in grad_pieces()]
    return pieces, module.autopar_plan.mesh, module.autopar_rank


def _refuse_unsynced(sync) -> None:
    if sync is not None and not sync.enabled:
        raise ClipError(
            "clip_grad_norm_ inside no_sync(): the gradients are still this rank's parts "
            "of the sums, so no rank knows the norm. Clip after the backward that syncs."
        )
    if sync is not None and sync.dp is not None and sync.dp.local_sgd_every is not None:
        raise ClipError(
            "clip_grad_norm_ with local SGD: each rank steps on its own gradient, there is "
            "no serial gradient to take the norm of. Clip each rank with "
            "torch.nn.utils.clip_grad_norm_ instead."
        )
