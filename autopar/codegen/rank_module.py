"""Building a rank's module, the one way for every program: a whole plan's (Plan.module) and a
pipeline stage's (parallel/pipeline/stage_module.py).

A rank module is an instance of the program's class (codegen/program.py) holding this rank's
piece of every parameter, buffer and constant it reads (as the techniques store them: zero=3
keeps a 1-D range), the per-rank constants the program reads, its dropout generator, the
techniques' run-time hooks and the guard that keeps a plain state_dict() away from DCP.

Its class carries ``RankModule``: the protocol rank modules share with pipeline runners, so
checkpoints and clipping ask a module for its tensors and gradient pieces instead of testing
what it is (``autopar_plan``, ``autopar_rank``, ``autopar_tensors()``, ``autopar_grad_pieces()``).

Example:
    >>> gm = build_rank_module(plan, 3, plan.program, class_name="Rank3Module")
    >>> gm.autopar_tensors()["fc1.weight"].shape            # rank 3's piece
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.codegen import dcp_guard
from autopar.codegen.emit import rank_attrs
from autopar.codegen.rank_state import set_attr
from autopar.placement import Replicate, counts_piece, shard_tensor
from autopar.runtime.rng import attach_state
from autopar.trace.meta_device import materialize


class RankModule:
    """The protocol of a rank's program (mixed into every rank module's class; a PipelineRunner
    implements the same names): the plan, the rank, the tensors under serial names, and the
    gradient pieces with whether this rank counts each in a whole-model sum."""

    autopar_plan = None
    autopar_rank = None
    autopar_constants: tuple = ()  # the traced constants it holds as plain attributes (their paths)

    @property
    def autopar_device(self) -> torch.device:
        """Where the program makes its tensors (codegen/device_args.py): its parameters' device (its
        buffers', the CPU without either), kept until the module is moved (``_apply``)."""
        device = self.__dict__.get("_autopar_device")
        if device is None:
            first = next(self.parameters(), None)
            first = first if first is not None else next(self.buffers(), None)
            device = first.device if first is not None else torch.device("cpu")
            self.__dict__["_autopar_device"] = device
        return device

    def _apply(self, fn, recurse=True):
        """``module.to(device)``, ``.cuda()``, ``.half()``: the traced constants (plain attributes,
        not in the state dict) move with the parameters and buffers, as a buffer would."""
        super()._apply(fn, recurse)
        for fqn in self.autopar_constants:
            path, _, leaf = fqn.rpartition(".")
            owner = self.get_submodule(path)
            setattr(owner, leaf, fn(getattr(owner, leaf)))
        self.__dict__.pop("_autopar_device", None)
        return self

    def autopar_tensors(self, all_buffers: bool = False) -> dict:
        """Serial name -> this rank's tensor: parameters (tied names too) and persistent buffers
        (``all_buffers``: the non-persistent ones too)."""
        tensors = dict(self.named_parameters(remove_duplicate=False))
        persistent = self.autopar_plan.persistent_buffers
        tensors.update((n, b) for n, b in self.named_buffers() if all_buffers or n in persistent)
        return tensors

    def autopar_grad_pieces(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, gradient, counted by this rank) of every gradient this rank holds: a piece is
        counted on one rank of each axis it is not split on (and, stored in pieces by a technique,
        where the technique says); the techniques add what they keep elsewhere (ZeRO's slices)."""
        plan, rank = self.autopar_plan, self.autopar_rank
        coords, techniques = plan.mesh.coords(rank), plan.options.techniques
        default = (None,) * plan.mesh.ndim
        pieces = []
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            skip = tuple(a for t in techniques for a in t.stored_axes(plan, name))
            once = all(t.counts_stored(plan, rank, name) for t in techniques) if skip else True
            pieces.append((name, p.grad, once and counts_piece(plan.param_specs.get(name, default), coords, skip)))
        for technique in techniques:
            pieces = technique.grad_pieces(plan, self, rank, pieces)
        return pieces


def build_rank_module(
    plan, rank: int, program, *, class_name: str, names=None, state=None, pieces=None, before_techniques=()
) -> nn.Module:
    """``rank``'s module of ``program``: its pieces of ``names`` (default: every parameter,
    buffer and constant of the model, so that state_dict() has the serial keys) from ``state``
    (default: the model's values), made once per rank in ``pieces`` (fqn -> tensor, shared by a
    rank's stage modules so that a weight two stages read is one Parameter). ``before_techniques``:
    hooks ``(plan, module, rank)`` run before the techniques attach theirs (the gradient sync)."""
    gm = program.instance(class_name)
    pieces, owners = ({} if pieces is None else pieces), _Owners(gm)
    for fqn in _names(plan) if names is None else names:
        owners.register(fqn, piece(plan, rank, fqn, state, pieces), _persistent(plan, fqn))
    gm.autopar_constants = tuple(n for n in plan.traced.constants if names is None or n in names)
    for name, value in rank_attrs(plan.mesh, rank).items():  # what the program reads per rank
        setattr(gm, name, value)
    attach_state(gm, plan)  # the dropout generator (runtime/rng.py)
    gm.autopar_plan, gm.autopar_rank = plan, rank  # what checkpoints and clipping read
    for hook in before_techniques:
        hook(plan, gm, rank)
    for technique in plan.options.techniques:
        technique.attach(plan, gm, rank)
    dcp_guard.install(gm, plan)  # a plain state_dict() given to DCP fails loudly
    return gm


class _Owners:
    """Registers tensors under dotted names on ``root``, making each plain submodule on the way
    once (a walk with hasattr per name is most of the time of building a deep model's module)."""

    def __init__(self, root: nn.Module):
        self.mods = {"": root}

    def register(self, fqn: str, value, persistent) -> None:
        path, _, leaf = fqn.rpartition(".")
        set_attr(self._module(path), leaf, value, persistent)

    def _module(self, path: str) -> nn.Module:
        mod = self.mods.get(path)
        if mod is None:
            parent_path, _, name = path.rpartition(".")
            parent = self._module(parent_path)
            mod = getattr(parent, name, None)
            if mod is None:
                mod = nn.Module()
                parent.add_module(name, mod)
            self.mods[path] = mod
        return mod


def piece(plan, rank: int, fqn: str, state, pieces: dict):
    """This rank's piece of parameter/buffer/constant ``fqn`` (a Parameter as the techniques
    store it; tied names share one), made once per rank."""
    if fqn in pieces:
        return pieces[fqn]
    tensors = plan.model_tensors
    spec = plan.param_specs.get(fqn, (Replicate(),) * plan.mesh.ndim)
    if fqn in tensors["params"]:
        p = tensors["params"][fqn]
        value = state[fqn] if state is not None and fqn in state else p
        local = _own(shard_tensor(value.detach(), spec, plan.mesh, rank), plan.traced.materialize_device)
        for technique in plan.options.techniques:  # what the rank stores (zero=3: its 1-D range)
            local = technique.stored(plan, rank, fqn, local)
        made = nn.Parameter(local, requires_grad=p.requires_grad)
        pieces.update({other: made for other, q in tensors["params"].items() if q is p})  # tied names: one
        return made
    value = tensors["buffers"][fqn] if fqn in tensors["buffers"] else plan.traced.constants[fqn]
    pieces[fqn] = _own(shard_tensor(value, spec, plan.mesh, rank), plan.traced.materialize_device)
    return pieces[fqn]


def _own(local: torch.Tensor, device) -> torch.Tensor:
    """This rank's own copy of a piece. A meta piece holds no data: a new empty one of its shape
    (cloning a strided meta view runs torch's Python reference checks, about half the time of
    building a rank module of a 70B-shaped model), materialised where the inputs are, if real."""
    if local.device.type == "meta":
        return materialize(torch.empty(local.shape, dtype=local.dtype, device="meta"), device)
    return local.clone()


def tensor_slots(plan) -> dict[str, str]:
    """Where a rank module holds each parameter and buffer of the plan (``piece`` registers them
    so, on the module of their path): target -> ``"_parameters"`` or ``"_buffers"``. The
    program reads them from these dicts (codegen/fast_calls.py); a constant, a plain
    attribute, is read through its path."""
    tensors = plan.model_tensors
    return {**{n: "_parameters" for n in tensors["params"]}, **{n: "_buffers" for n in tensors["buffers"]}}


def _names(plan) -> list[str]:
    t = plan.model_tensors
    return list(t["params"]) + list(t["buffers"]) + list(plan.traced.constants)


def _persistent(plan, fqn: str):
    """Whether buffer ``fqn`` is in the state dict (None: not a buffer)."""
    return fqn in plan.persistent_buffers if fqn in plan.model_tensors["buffers"] else None
