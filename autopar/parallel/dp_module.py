"""What a Plan knows about its gradient sync: the buckets each rank will use, the sync attached
to a rank's module, and the memory each rank holds (the storage policies change it).

Example:
    >>> for b in plan.grad_buckets(): print(b.names, b.nbytes)
    >>> plan.memory_per_rank(state_slots=2)["optimizer_state"]   # bytes on rank 0 (Adam: 2 slots)
"""

from __future__ import annotations

import torch

from autopar.cost.formulas import Numbers
from autopar.cost.plan_cost import activation_terms, copy_bytes, copy_dtype, memory_phases, phase_flags
from autopar.parallel.grad_buckets import DEFAULT_BUCKET_MB, make_buckets
from autopar.parallel.grad_sync import GradSync
from autopar.parallel.param_names import held_params, param_order


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


def sync_order(plan) -> list[str]:
    """The parameter names in the order their gradients reach the gradient sync: backward's
    (``param_order``), as the techniques that set gradients themselves change it (zero=3: a
    bucket's pieces at once, after its reduce-scatter). The sync makes its buckets in this order
    and again from the order its first backward sees: the same where this is right."""
    order = param_order(plan)
    for technique in plan.options.techniques:
        order = technique.grad_order(plan, order)
    return order


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
        order=sync_order(plan),
    )
    gm.autopar_grad_sync = sync
    gm.no_sync = sync.no_sync
    if sync.shards is not None:  # model.zero_grad() clears ZeRO-2's slices too, as opt.zero_grad() does
        gm.zero_grad = _zero_grad_with_slices(gm.zero_grad, sync.shards)


def _zero_grad_with_slices(module_zero_grad, shards):
    def zero_grad(set_to_none: bool = True) -> None:
        module_zero_grad(set_to_none)
        shards.clear_grads(set_to_none)

    return zero_grad


def bucket_limits(plan) -> tuple[int, int | None, int | None]:
    """(bucket bytes, bucket max params, first bucket bytes): the data-parallel options', or
    the defaults where gradients are synced on other axes only (first bucket: no special size)."""
    dp = plan.data_parallel
    if dp is None:
        return int(DEFAULT_BUCKET_MB * 2**20), None, None
    return dp.bucket_bytes, dp.bucket_max_params, dp.first_bucket_bytes


def grad_buckets(plan, rank: int = 0, stored: dict | None = None):
    """The gradient buckets of ``rank`` (the same on every rank of its dp group), in launch order;
    under a pipeline, of its stages' parameters (as its runner makes them). ``stored``: the pieces
    the rank's module holds (``param_names.stored_pieces``), which its sync buckets by their
    sizes (zero=3: a norm weight synced on tp is whole on one rank, empty on another); None:
    the compute pieces'."""
    size, count, first = bucket_limits(plan)
    if plan.stage_layout is not None:  # a pipeline's runner makes its sync without the small first bucket
        first = None
    params = held_params(plan, rank)
    if stored is not None:
        params = {n: stored.get(n, p).detach().requires_grad_(p.requires_grad) for n, p in params.items()}
    return make_buckets(params, sync_axes_all_names(plan), size, count, sync_order(plan), first)


class RankMemory(dict):
    """Bytes one rank holds, by part. ``mem.phases`` is what each phase of a step holds
    (plan_cost.memory_phases: forward, backward, optimizer), ``mem.phase`` the largest and
    ``mem.peak`` its bytes: the rank's memory, the figure ap.predict, plan.cost()'s
    ``peak_memory`` and the search give, and a dry run measures (docs/dry_run.md).
    ``sum(mem.values())`` (``mem.total``) adds every part, as though all were alive at once: an
    upper bound, since no phase holds every part (the loss's backward holds no gradient yet).
    Figures that are not bytes held (the dp size, the ZeRO level, what zero=0 would keep, host
    memory) are in ``mem.info``, and ``mem[key]`` reads them there too.

    Example:
        >>> mem = plan.memory_per_rank(2)
        >>> mem.peak == mem.phases[mem.phase]     # the largest phase's bytes (mem.phase: "backward")
        >>> mem.total == sum(mem.values())        # params + grads + optimizer_state + activations + ...
        >>> mem["optimizer_state_unsharded"]      # mem.info's: what zero=0 would keep
    """

    INFO = (
        "dp",
        "zero",
        "optimizer_state_unsharded",
        "params_unsharded",
        "shard_size",
        "offloaded",
        "trainable_elements",
    )

    def __init__(self, mem: dict, grads_in_backward: bool = False, gathered_in_backward: bool = False):
        super().__init__({k: v for k, v in mem.items() if k not in self.INFO})
        self.info = {k: v for k, v in mem.items() if k in self.INFO}
        self.phases = memory_phases(self, grads_in_backward, gathered_in_backward)
        self.phase = max(self.phases, key=self.phases.get)

    def __missing__(self, key):
        return self.info[key]

    def get(self, key, default=None):
        """``mem.get(key)`` reads ``info`` too, as ``mem[key]`` does (dict.get skips __missing__)."""
        return super().get(key, self.info.get(key, default))

    @property
    def total(self) -> int:
        """Every part added: an upper bound of ``peak``."""
        return sum(self.values())

    @property
    def peak(self) -> float:
        """The rank's memory: its largest phase's bytes."""
        return self.phases[self.phase]


def memory_per_rank(plan, rank: int = 0, state_slots: int = 2) -> RankMemory:
    """Bytes ``rank`` holds, by part (RankMemory: ``.peak``, its largest phase, is the rank's memory):

    - ``params``: the parameter pieces its modules hold (its pipeline stages' only; tensor- or
      ZeRO-3-split: its piece, padding included), in their dtype;
    - ``grads``: the gradients it keeps after backward (ZeRO-2/3: its slice);
    - ``optimizer_state``: ``state_slots`` values per element it steps, in the parameter's dtype
      (torch's optimizers make their state with zeros_like; a precision policy's masters are fp32)
      (ZeRO-1/2/3: its slice): Adam/AdamW 2, SGD with momentum 1, plain SGD 0;
    - what the storage holds beside (``accumulated``: gradients kept whole over a pipeline's
      micro-batches; zero=3's ``gathered`` blocks and ``reduce_buffers``);
    - ``compute_copies``: a precision policy's ``param_dtype`` copies of the parameters the
      program reads without a gather (zero 0-2, no data parallel: cost/plan_cost.copy_bytes);
    - the activations autograd keeps at the example's sizes, as the techniques change them
      (cost/plan_cost.activation_terms: ``activations``, checkpointing's ``recompute``, a
      lowering's ``workspace``, the loss's ``backward``, gathered ``outputs``; a pipeline rank:
      its stages' micro-batches in flight).

    Host memory (``offloaded`` checkpoints) is in ``info``. plan.cost(rank=r) counts the same
    parts as formulas (its ``padding``: the buckets' padding, a number; its ``peak_memory`` the
    largest phase) and ap.predict's memory is the peak of the rank that holds the most
    (``peak_memory_rank``).
    """
    dp = plan.data_parallel
    params = held_params(plan, rank)
    total = sum(p.numel() * p.element_size() for p in params.values())
    trainable = sum(p.numel() * p.element_size() for p in params.values() if p.requires_grad)
    elements = sum(p.numel() for p in params.values() if p.requires_grad)
    mem = {
        "params": total,
        "grads": trainable,
        "optimizer_state": state_slots * trainable,
        "optimizer_state_unsharded": state_slots * trainable,
        "trainable_elements": elements,
        "dp": plan.mesh.shape[plan.dp_axis] if plan.dp_axis is not None else 1,
        "zero": dp.zero if dp is not None else 0,
    }
    for technique in plan.options.techniques:
        mem = technique.memory(plan, rank, state_slots, mem)
    dtype = copy_dtype(plan)  # a precision policy's param_dtype copies of the fp32 masters
    kept = plan.traced.kept_fp32  # HF's keep-in-fp32 parameters: read as they are, no copy
    copies = sum(copy_bytes(p, p.numel(), None if n in kept else dtype) for n, p in params.items())
    if copies:
        mem["compute_copies"] = copies
    # what autograd keeps (cost/activation_memory.py), as the techniques change it (checkpointing)
    mem.update({k: float(v) for k, v in activation_terms(plan, Numbers(plan.mesh), rank).items()})
    return RankMemory(mem, **phase_flags(plan))


def memory_ranks(plan) -> list[int]:
    """The ranks whose memory can differ (rank 0 and those the techniques name: one per
    pipeline position), in order."""
    ranks = {0}
    for technique in plan.options.techniques:
        ranks.update(technique.memory_ranks(plan))
    return sorted(ranks)


def peak_memory_rank(plan, state_slots: int = 2) -> int:
    """The rank that holds the most at its step's peak (``memory_per_rank``'s peak): the one
    plan.cost() and ap.predict answer for. Kept on the plan per ``state_slots``."""
    held = plan.__dict__.setdefault("_peak_memory_rank", {})
    if state_slots not in held:
        totals = {r: memory_per_rank(plan, r, state_slots).peak for r in memory_ranks(plan)}
        held[state_slots] = max(totals, key=lambda r: (totals[r], -r))
    return held[state_slots]
