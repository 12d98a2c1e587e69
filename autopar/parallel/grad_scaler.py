"""ap.GradScaler: fp16 loss scaling where every rank takes the same skip decision.

``torch.amp.GradScaler`` checks the gradients its optimizer holds for inf/NaN and skips the
step where it finds one. On a rank module those are this rank's pieces only: a tensor-parallel
shard, a ZeRO slice, one pipeline stage's parameters. An overflow in rank 0's piece and not in
rank 1's makes rank 0 skip and halve its scale while rank 1 steps and keeps its own: the
replicas part silently (tp=2, SGD, an inf in rank 0's piece: rank 1's weights move 2.6e-2,
rank 0's not at all). ap.GradScaler is torch's GradScaler (same arguments, same ``scale``,
``unscale_``, ``step``, ``update``, ``state_dict``) whose inf check adds every rank's finding
(one all-reduce of one number per mesh axis, every axis: tp, dp, cp, pp, ep), so every rank
skips or steps together and every rank's scale stays the same, as FSDP's ShardedGradScaler
does over its process group.

``unscale_(opt)`` and ``step(opt)`` are collective: every rank of the plan calls them, for the
same optimizers in the same order. Unscale before clipping, as with torch:
``scaler.unscale_(opt); ap.clip_grad_norm_(module, 1.0); scaler.step(opt); scaler.update()``.
A pipeline runner scales its backward itself: ``runner.step(batch, labels, scaler=scaler)``.

A plain ``torch.amp.GradScaler`` (or any other GradScaler) stepping an optimizer over a rank
module's parameters is refused at its first step with a PlanError naming ap.GradScaler.

Example:
    >>> scaler = ap.GradScaler(module, init_scale=2.0**12)     # device: the module's
    >>> with torch.autocast("cuda", dtype=torch.float16):
    ...     loss = loss_fn(module(x), y)
    >>> scaler.scale(loss).backward()
    >>> scaler.step(opt); scaler.update(); opt.zero_grad()
"""

from __future__ import annotations

import sys
import types

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from autopar.errors import PlanError
from autopar.parallel.optimizer import Optimizer, _plan_and_rank
from autopar.parallel.protocols.storage import SlicedOptimizer
from autopar.runtime.backend import current_backend

RANK_PARAMS = WeakIdKeyDictionary()  # parameters of rank modules on meshes of 2+ ranks (by identity)
CALLER_DEPTH = 8  # frames above an optimizer step searched for the GradScaler that drives it


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose found-inf decision is the same on every rank of ``module``'s
    plan. ``module``: a rank module (``plan.module(r)``, ``ap.parallelize``) or a pipeline
    runner. ``device``: where the scale lives (default: the module's parameters' device). The
    other keywords are torch.amp.GradScaler's (init_scale, growth_factor, backoff_factor,
    growth_interval, enabled)."""

    def __init__(self, module, device: str | torch.device | None = None, **kwargs):
        self.plan, self.rank = _plan_and_rank(module)
        self.module = module
        if device is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else "cpu"
        super().__init__(torch.device(device).type, **kwargs)
        if self._enabled:  # now, not at the first scale(): a pipeline stage without the loss never calls it
            self._lazy_init_scale_growth_tracker(torch.device(device))

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's check-and-unscale over the gradients ``optimizer`` steps on this rank, then
        every rank's finding added up: the result is 1 on every rank if any rank found one."""
        held = types.SimpleNamespace(param_groups=[{"params": stepped_tensors(optimizer)}])
        per_device = super()._unscale_grads_(held, inv_scale, found_inf, allow_fp16)
        if not per_device:  # nothing to check here (no gradient this step): this rank found nothing
            per_device = {found_inf.device: found_inf}
        self._agree(per_device)
        return per_device

    def _agree(self, per_device: dict) -> None:
        """Every rank's found_inf summed over each mesh axis in turn (so over the whole mesh),
        written back as 0 or 1 into each device's tensor."""
        where = self._scale.device
        total = sum(v.to(where, torch.float32) for v in per_device.values()).reshape(1)
        mesh, backend = self.plan.mesh, current_backend()
        for axis in range(mesh.ndim):
            if mesh.shape[axis] > 1:
                total = backend.all_reduce(total, tuple(mesh.group(axis, self.rank)), self.rank, "sum")
        decided = (total > 0).to(torch.float32).reshape(())
        for v in per_device.values():
            v.copy_(decided.to(v.device))


def stepped_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` ``optimizer`` reads when it steps on this rank: its
    parameters, or, for an ap.Optimizer that gathers whole tensors, the rank's pieces it gathers
    from (its own parameters are whole-tensor copies filled only inside its step)."""
    own = getattr(optimizer, "stepped_tensors", None)
    if own is not None:
        return own()
    return [p for group in optimizer.param_groups for p in group["params"]]


# ------------------------------------------------------------------ the guard on plain scalers
def mark_rank_params(plan, module: torch.nn.Module, rank: int) -> None:
    """Remember ``module``'s parameters when its plan has 2+ ranks (a hook of the rank-module
    builder), so that a plain GradScaler stepping them is refused."""
    if plan.mesh.size > 1:
        for p in module.parameters():
            RANK_PARAMS[p] = True


def _driving_scaler():
    """The GradScaler whose ``step`` called this optimizer step, if one did (a few frames up:
    GradScaler.step -> _maybe_opt_step -> the optimizer's step wrapper -> this hook)."""
    frame = sys._getframe(2)
    for _ in range(CALLER_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name in ("step", "_maybe_opt_step"):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.amp.GradScaler):
                return owner
        frame = frame.f_back
    return None


def _on_ranks(optimizer) -> bool:
    if isinstance(optimizer, (Optimizer, SlicedOptimizer)):  # its tensors are not the module's: ask the module
        plan = getattr(optimizer.module, "autopar_plan", None)
        return plan is not None and plan.mesh.size > 1
    return any(p in RANK_PARAMS for group in optimizer.param_groups for p in group["params"])


def _refuse_plain_scaler(optimizer, args, kwargs) -> None:
    """Refused rather than made to work: a plain scaler decides in its own unscale_, before any
    optimizer hook runs, and a rank that skips never calls step at all, so no hook autopar owns
    sees every rank's finding in time to change it. Making torch's GradScaler agree would mean
    patching its private _unscale_grads_ for every user of torch in the process. So each rank
    that reaches a step through a plain scaler raises before it moves a weight: in a normal first
    step, every rank; where only some overflowed, the ones that would have stepped."""
    scaler = _driving_scaler()
    if scaler is None or isinstance(scaler, GradScaler) or not _on_ranks(optimizer):
        return
    raise PlanError(
        f"{type(scaler).__module__}.{type(scaler).__name__} steps {type(optimizer).__name__} over a rank module's "
        "parameters: it checks only this rank's gradient pieces for inf/NaN, so one rank can skip the step "
        "while another takes it, and the replicas part silently. Use scaler = ap.GradScaler(module, "
        "device=..., **the same keywords): the same methods, one decision on every rank."
    )


register_optimizer_step_pre_hook(_refuse_plain_scaler)
