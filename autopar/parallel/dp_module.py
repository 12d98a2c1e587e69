"""What a Plan knows about data parallelism: the gradient buckets each rank will use, the
sync attached to a rank's module, and the memory ZeRO saves per rank.

Example:
    >>> for b in plan.grad_buckets(): print(b.names, b.nbytes)
    >>> plan.memory_per_rank(state_slots=2)["optimizer_state"]   # bytes on rank 0 (Adam: 2 slots)
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.parallel.data_parallel import DEFAULT_BUCKET_MB
from autopar.parallel.grad_sync import GradSync, make_buckets
from autopar.placement import Replicate, local_shape


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


def param_order(plan) -> list[str]:
    """Parameter names in the order backward completes their gradients: the reverse of their
    first use in the forward graph (the same on every rank: it comes from the plan's graph)."""
    nodes = list(plan.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    first = {}
    for node in nodes:
        fqn = plan.traced.param_fqn.get(node.name) if node.op == "placeholder" else None
        if fqn is not None:
            first[fqn] = min((pos[u] for u in node.users), default=len(nodes))
    for names in plan.traced.tied.values():  # a tied tensor: its first use under any of its names
        uses = [first[n] for n in names if n in first]
        first.update({n: min(uses) for n in names} if uses else {})
    return sorted(first, key=lambda n: -first[n])


def attach(plan, gm: torch.nn.Module, rank: int) -> None:
    """Give ``gm`` its gradient sync (and local SGD, if asked) as plan.build_module does."""
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


def exact_gradients(plan):
    """The plan with fp32 gradient sums on dp (what Plan.check compares with serial): ZeRO-1/2,
    local SGD, a reduce dtype and a precision policy change what the optimizer gets, not the
    layouts. zero=3 stays (with its sharding, prefetch and resharding): its gathers and
    reduce-scatters are exact in fp32, and its stored pieces merge into the full gradients, so
    check runs the program that trains."""
    dp = plan.data_parallel
    keep = dp is not None and dp.zero == 3
    exact = (
        dataclasses.replace(
            dp,
            zero=3 if keep else 0,
            local_sgd_every=None,
            reduce_dtype=None,
            reshard_after_forward=dp.reshard_after_forward if keep else True,
            prefetch=dp.prefetch if keep else 1,
            shard_size=dp.shard_size if keep else None,
            param_dtype=None,
            output_dtype=None,
        )
        if dp is not None
        else None
    )
    return plan if exact == dp else plan.with_data_parallel(exact)


def local_params(plan, rank: int = 0) -> dict[str, torch.Tensor]:
    """Meta tensors with this rank's local shapes (deduplicated names, as a module has them)."""
    out = {}
    for n, p in plan.model.named_parameters():
        spec = plan.param_specs.get(n, (Replicate(),) * plan.mesh.ndim)
        shape = local_shape(tuple(p.shape), spec, plan.mesh)
        out[n] = torch.empty(shape, dtype=p.dtype, device="meta").requires_grad_(p.requires_grad)
    return out


def held_params(plan, rank: int = 0) -> dict[str, torch.Tensor]:
    """``local_params`` of the parameters ``rank``'s modules hold: all of them, or under a
    pipeline those its stages read (a weight tied across stages is held by each)."""
    params, lay = local_params(plan, rank), plan.stage_layout
    if lay is None:
        return params
    from autopar.parallel.fsdp import canonical_names

    canon, pos = canonical_names(plan), plan.mesh.coords(rank)[lay.axis]
    read = {plan.attr_name(ph) for st in lay.stages if lay.rank_of_stage(st.index) == pos for ph in st.attrs}
    held = {canon.get(n, n) for n in read if n is not None}
    return {n: p for n, p in params.items() if canon.get(n, n) in held}


def grad_buckets(plan, rank: int = 0):
    """The gradient buckets of ``rank`` (the same on every rank of its dp group), in launch order;
    under a pipeline, of its stages' parameters (as its runner makes them)."""
    size, count, first = bucket_limits(plan)
    return make_buckets(held_params(plan, rank), sync_axes_all_names(plan), size, count, param_order(plan), first)


def memory_per_rank(plan, rank: int = 0, state_slots: int = 2) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients (after backward) and optimizer state.

    ``state_slots``: optimizer state tensors per parameter element (Adam/AdamW 2, SGD with
    momentum 1, plain SGD 0). ZeRO divides the optimizer state of the dp buckets by dp (and,
    at stage 2, their gradients); ``optimizer_state_unsharded`` is what zero=0 would hold.
    """
    dp = plan.data_parallel
    params = held_params(plan, rank)
    total = sum(p.numel() * p.element_size() for p in params.values())
    trainable = sum(p.numel() * p.element_size() for p in params.values() if p.requires_grad)
    n = plan.mesh.shape[plan.dp_axis] if plan.dp_axis is not None else 1
    kept = trainable  # bytes of trainable params this rank steps (ZeRO: its slice of each dp bucket)
    if dp is not None and dp.zero:
        for b in grad_buckets(plan, rank):
            if plan.dp_axis in b.axes:
                kept += (-(-b.numel // n) - b.numel) * b.dtype.itemsize
    grads = kept if dp is not None and dp.zero == 2 else trainable
    mem = {
        "params": total,
        "grads": grads,
        "optimizer_state": state_slots * kept,
        "optimizer_state_unsharded": state_slots * trainable,
        "dp": n,
        "zero": dp.zero if dp is not None else 0,
    }
    for technique in plan.options.techniques:
        mem = technique.memory(plan, rank, state_slots, mem)
    return mem
