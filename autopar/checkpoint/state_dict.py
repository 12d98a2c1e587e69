"""ap.get_state_dict / ap.set_state_dict: a rank's model and optimizer state under serial
names, as pieces of global tensors that torch.distributed.checkpoint (DCP) reshards.

Every value is a DTensor on the plan's DeviceMesh: with the plan's placements, or (blocked
shards, ZeRO slices, which no DTensor placement describes) one carrying the rank's boxes of
the global tensor for DCP (see wrap.py). Optimizer state
follows torch's layout: ``{"state": {serial name: {"exp_avg": ..., "step": ...}},
"param_groups": [{..., "params": [serial names]}]}``; a state tensor shaped like its
parameter (or ZeRO piece) is laid out like it, anything else (``step``) is saved as is.

Example:
    >>> model_sd, optim_sd = ap.get_state_dict(module, opt)
    >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    >>> # later, any plan, mesh or world size:
    >>> model_sd, optim_sd = ap.get_state_dict(module2, opt2)
    >>> dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    >>> ap.set_state_dict(module2, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
"""

from __future__ import annotations

import torch.distributed as dist
import torch

from autopar.checkpoint.target import Target, device_mesh
from autopar.errors import CheckpointError
from autopar.checkpoint.wrap import copy_boxes, to_checkpoint
from autopar.parallel.zero import ZeroOptimizer


def get_state_dict(module, optimizer=None) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) of this rank, for dcp.save / dcp.load."""
    t = Target.of(module)
    dm, world = device_mesh(t.plan), dist.get_world_size()
    model_sd = {}
    for fqn, local in t.tensors.items():
        start = t.stored_start(fqn)
        boxes = t.boxes(fqn, local.detach(), start)
        value = to_checkpoint(boxes, t.shape(fqn), t.spec(fqn), dm, t.rank, world, local if start is None else None)
        if value is not None:  # None: an empty zero=3 piece (nothing of it on this rank)
            model_sd[fqn] = value
    if optimizer is None:
        return model_sd, {}
    init_state(optimizer)
    state = {}
    for key, (fqn, start) in entries(t, optimizer).items():
        out = state.setdefault(fqn, {})
        for name, v in optimizer.state.get(key, {}).items():
            if _elementwise(v, key):
                boxes = t.boxes(fqn, v, start)
                value = to_checkpoint(boxes, t.shape(fqn), t.spec(fqn), dm, t.rank, world, v if start is None else None)
                if value is not None:  # None: an empty piece (nothing of it on this rank)
                    out[name] = value
            else:
                out[name] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return model_sd, {"state": state, "param_groups": groups}


def set_state_dict(module, optimizer=None, *, model_state_dict: dict, optim_state_dict: dict | None = None) -> None:
    """Copy this rank's pieces out of state dicts (from dcp.load into get_state_dict's dicts,
    or full serial tensors) into ``module`` and ``optimizer``."""
    t = Target.of(module)
    missing = sorted(n for n, v in t.tensors.items() if n not in model_state_dict and v.numel())
    if missing:
        raise CheckpointError(
            f"set_state_dict: the model state dict lacks {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; it was saved for another model."
        )
    with torch.no_grad():
        for fqn, local in t.tensors.items():
            if fqn in model_state_dict:
                copy_boxes(t.stored_boxes(fqn, local.detach()), model_state_dict[fqn], fqn, t.shape(fqn))
        if optimizer is not None and optim_state_dict:
            _set_optim(t, optimizer, optim_state_dict)


def _set_optim(t, optimizer, sd: dict) -> None:
    init_state(optimizer)
    saved = sd.get("state", {})
    for key, (fqn, start) in entries(t, optimizer).items():
        if fqn not in saved:
            raise CheckpointError(f"set_state_dict: the optimizer state dict has no state for {fqn!r}.")
        mine = optimizer.state[key]
        for name, v in list(mine.items()):
            src = saved[fqn].get(name)
            if src is None and v is not None:
                raise CheckpointError(
                    f"set_state_dict: optimizer state {fqn!r}[{name!r}] is missing; the "
                    f"checkpoint has {sorted(saved[fqn])} (another optimizer?)."
                )
            if _elementwise(v, key):
                copy_boxes(t.boxes(fqn, v, start), src, f"{fqn}.{name}", t.shape(fqn))
            elif isinstance(v, torch.Tensor):
                v.copy_(_whole(src))
            else:
                mine[name] = src
    for group, loaded in zip(optimizer.param_groups, sd.get("param_groups", [])):
        for k, v in loaded.items():
            if k != "params" and k in group and not isinstance(group[k], torch.Tensor):
                group[k] = v


def _whole(v):
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


def _elementwise(v, key: torch.Tensor) -> bool:
    """A state tensor laid out like its parameter (exp_avg), not a scalar (step)."""
    return isinstance(v, torch.Tensor) and v.shape == key.shape and key.dim() > 0


def entries(t: Target, optimizer) -> dict:
    """Each tensor the optimizer steps -> (serial name, None | start in the flattened local
    parameter for a ZeRO piece)."""
    out = {}
    if isinstance(optimizer, ZeroOptimizer):
        params = optimizer.module.autopar_grad_sync.params
        for piece in optimizer.shards.all_pieces():
            p = params[piece.name]
            out[piece.tensor] = (t.param_names[id(p)], piece.tensor.storage_offset() - p.storage_offset())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in out or p.numel() == 0:
                continue
            if id(p) not in t.param_names:
                raise CheckpointError(
                    "the optimizer steps a tensor that is not a parameter of the module "
                    "given: pass the module the optimizer was made for."
                )
            name = t.param_names[id(p)]
            out[p] = (name, t.stored_start(name))  # zero=3: the parameter is a 1-D range
    return out


def init_state(optimizer) -> None:
    """Create the optimizer's state where it has none yet (a fresh optimizer about to load):
    one step with zero gradients and lr 0, as torch.distributed.checkpoint.state_dict does."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.numel()]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g
