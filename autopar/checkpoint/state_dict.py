"""ap.get_state_dict / ap.set_state_dict: a rank's model and optimizer state under serial
names, as pieces of global tensors that torch.distributed.checkpoint (DCP) reshards.

Every value is a DTensor on the plan's DeviceMesh whose ``full_tensor()`` is the serial tensor:
with the plan's placements, or (blocked shards, ZeRO slices, zero=3 pieces, pipeline stages,
which no DTensor placement describes) a Pieces carrying the rank's boxes of the global tensor
(pieces.py). Every rank gets every key, in one order. Optimizer state
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

from autopar.checkpoint.pieces import Pieces
from autopar.checkpoint.target import Target, device_mesh
from autopar.errors import CheckpointError
from autopar.checkpoint.wrap import copy_boxes, to_checkpoint
from autopar.parallel.protocols.storage import SlicedOptimizer


def get_state_dict(module, optimizer=None) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) of this rank, for dcp.save / dcp.load. Every rank
    gets the same keys in the same order (a value's full_tensor() is a collective)."""
    t = Target.of(module)
    dm, world = device_mesh(t.plan), dist.get_world_size()
    model_sd = {}
    for fqn in t.names():
        local = t.tensors.get(fqn)
        if local is None:  # a pipeline rank without this stage's tensors
            model_sd[fqn] = Pieces.of([], t.shape(fqn), dm, t.dtype(fqn))
            continue
        start = t.stored_start(fqn)
        boxes = t.boxes(fqn, local.detach(), start)
        plain = local if start is None and t.whole else None
        model_sd[fqn] = to_checkpoint(boxes, t.shape(fqn), t.spec(fqn), dm, t.rank, world, plain, local.dtype)
    if optimizer is None:
        return model_sd, {}
    if getattr(optimizer, "whole", None) is not None:  # ap.Optimizer stepping whole tensors
        return model_sd, whole_state(optimizer)
    optimizer = getattr(optimizer, "inner", optimizer)  # ap.Optimizer stepping pieces: its optimizer
    init_state(optimizer)
    state = {}
    for key, (fqn, start) in entries(t, optimizer).items():
        out = state.setdefault(fqn, {})
        for name, v in optimizer.state.get(key, {}).items():
            if _elementwise(v, key):
                plain = v if start is None and t.whole else None
                boxes = t.boxes(fqn, v, start)
                out[name] = to_checkpoint(boxes, t.shape(fqn), t.spec(fqn), dm, t.rank, world, plain, v.dtype)
            else:
                out[name] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return model_sd, {"state": same_on_every_rank(state, t, dm), "param_groups": groups}


def whole_state(optimizer) -> dict:
    """ap.Optimizer's state when it steps whole tensors: whole on (and equal on) every rank, saved
    as plain tensors under serial names."""
    init_state(optimizer.inner)
    state = {n: dict(optimizer.inner.state.get(s, {})) for n, s in optimizer.whole.shadows.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _set_whole(optimizer, sd: dict) -> None:
    init_state(optimizer.inner)
    for name, shadow in optimizer.whole.shadows.items():
        mine, saved = optimizer.inner.state[shadow], sd.get("state", {}).get(name, {})
        for key, v in list(mine.items()):
            if key not in saved:
                raise CheckpointError(f"set_state_dict: optimizer state {name!r}[{key!r}] is missing.")
            src = _whole(saved[key])
            if isinstance(v, torch.Tensor):
                v.copy_(src.reshape(v.shape))
            else:
                mine[key] = src
    _set_groups(optimizer, sd)


def same_on_every_rank(state: dict, t: Target, dm) -> dict:
    """The optimizer state with every (parameter, state name) any rank has, in one order: a rank
    holding no piece of a parameter (ZeRO, zero=3's empty pieces, another pipeline stage) gets
    an empty Pieces for its elementwise state and the holders' value of the rest (``step``)."""

    mine = {fqn: {n: _kind(v) for n, v in named.items()} for fqn, named in state.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for fqn in t.names():
        names = sorted({n for e in everyone for n in e.get(fqn, {})})
        for name in names:
            value = state.get(fqn, {}).get(name)
            if value is None:
                kind, what = next(e[fqn][name] for e in everyone if name in e.get(fqn, {}))
                if kind == "dtensor":
                    raise CheckpointError(f"optimizer state {fqn!r}[{name!r}] is laid out on some ranks only.")
                value = Pieces.of([], t.shape(fqn), dm, what) if kind == "pieces" else what
            out.setdefault(fqn, {})[name] = value
    return out


def _kind(v) -> tuple:
    from torch.distributed.tensor import DTensor

    if isinstance(v, Pieces):
        return "pieces", v.dtype
    if isinstance(v, DTensor):
        return "dtensor", None
    return "value", v


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
    if getattr(optimizer, "whole", None) is not None:
        return _set_whole(optimizer, sd)
    optimizer = getattr(optimizer, "inner", optimizer)
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
    _set_groups(optimizer, sd)


def _set_groups(optimizer, sd: dict) -> None:
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
    if isinstance(optimizer, SlicedOptimizer):  # it steps slices of the parameters (ZeRO-1/2): each from its start
        for piece, (p, start) in optimizer.param_slices().items():
            out[piece] = (t.param_names[id(p)], start)
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
