"""What a Plan knows about its gradient sync: the buckets each rank will use, the sync attached
to a rank's module, and the memory each rank holds (the storage policies change it).

Example:
    >>> for b in plan.grad_buckets(): print(b.names, b.nbytes)
    >>> plan.memory_per_rank(state_slots=2)["optimizer_state"]   # bytes on rank 0 (Adam: 2 slots)
"""

from __future__ import annotations

import torch

from autopar.cost.formulas import Numbers
from autopar.cost.plan_cost import activation_terms
from autopar.parallel.grad_buckets import DEFAULT_BUCKET_MB, make_buckets
from autopar.parallel.grad_sync import GradSync
from autopar.parallel.param_names import held_params, param_order
from autopar.parallel.precision import compute_copies


def sync_axes_all_names(plan) -> dict[str, tuple[int, ...]]:
    """grad_sync_axes under every name of a tied parameter (a module may register either)."""
    axes = dict(plan.grad_sync_axes)
    for names in plan.traced.tied.values():
        found = next((axes[n] for n in names if n in axes), None)
        if found is not None:
            axes.update({n: found for n in names})
    for technique in plan.options.techniques:
        axes = technique.grad_sync_axes(plan, axes)
    return axes


def attach(plan, gm: torch.nn.Module, rank: int) -> None:
    """Give ``gm`` its gradient sync as the rank-module builder does."""
    sync = GradSync(
        gm,
        sync_axes_all_names(plan),
        plan.mesh,
        rank,
        *bucket_limits(plan)[:2],
        dp=plan.data_parallel,
        dp_axis=plan.dp_axis,
        order=param_order(plan),
    )
    gm.autopar_grad_sync = sync
    gm.no_sync = sync.no_sync


def bucket_limits(plan) -> tuple[int, int | None, int | None]:
    """(bucket bytes, bucket max params, first bucket bytes): the data-parallel options', or
    the defaults where gradients are synced on other axes only (first bucket: no special size)."""
    dp = plan.data_parallel
    if dp is None:
        return int(DEFAULT_BUCKET_MB * 2**20), None, None
    return dp.bucket_bytes, dp.bucket_max_params, dp.first_bucket_bytes


def grad_buckets(plan, rank: int = 0):
    """The gradient buckets of ``rank`` (the same on every rank of its dp group), in launch order;
    under a pipeline, of its stages' parameters (as its runner makes them)."""
    size, count, first = bucket_limits(plan)
    return make_buckets(held_params(plan, rank), sync_axes_all_names(plan), size, count, param_order(plan), first)


def memory_per_rank(plan, rank: int = 0, state_slots: int = 2) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients (after backward) and optimizer state, and
    the activations autograd keeps at the example's sizes (``recompute``: checkpointing's peak).

    ``state_slots``: optimizer state tensors per parameter element (Adam/AdamW 2, SGD with
    momentum 1, plain SGD 0). The techniques change what is kept (ZeRO divides the optimizer
    state of the dp buckets by dp, and at stage 2 their gradients); ``optimizer_state_unsharded``
    is what zero=0 would hold.
    """
    dp = plan.data_parallel
    params = held_params(plan, rank)
    total = sum(p.numel() * p.element_size() for p in params.values())
    trainable = sum(p.numel() * p.element_size() for p in params.values() if p.requires_grad)
    mem = {
        "params": total,
        "grads": trainable,
        "optimizer_state": state_slots * trainable,
        "optimizer_state_unsharded": state_slots * trainable,
        "dp": plan.mesh.shape[plan.dp_axis] if plan.dp_axis is not None else 1,
        "zero": dp.zero if dp is not None else 0,
    }
    for technique in plan.options.techniques:
        mem = technique.memory(plan, rank, state_slots, mem)
    if compute_copies(plan, params):  # a precision policy's param_dtype copies of the fp32 masters
        mem["compute_copies"] = compute_copies(plan, params)
    # what autograd keeps (cost/activation_memory.py), as the techniques change it (checkpointing)
    mem.update({k: int(v) for k, v in activation_terms(plan, Numbers(plan.mesh), rank).items()})
    return mem
