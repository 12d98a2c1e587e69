"""A rank module's plain ``state_dict()`` handed to DCP fails loudly instead of saving each
rank's shard as if it were the whole tensor.

``module.state_dict()`` of an emitted rank module holds local pieces (what per-rank
``torch.save`` and ``plan.merge_state_dicts`` want), and DCP would record a [64, 32] shard
of a [128, 32] weight as a whole [64, 32] tensor and load it back anywhere, silently
wrong. A state-dict hook tags every split piece with the hooks DCP consults first
(``__create_write_items__``, ``__create_chunk_list__`` when saving; on loading, DCP first
compares the entry's ``size()`` with the saved global size): they raise, naming what to call.
Replicated entries are whole tensors and stay as they are. The tag is a picklable object,
so ``torch.save(module.state_dict())`` still works.

Example:
    >>> dcp.save(module.state_dict(), checkpoint_id=path)
    CheckpointError: 'fc1.weight' is this rank's piece (split (S(0),)) ... ap.get_state_dict(module)
"""

from __future__ import annotations

import sys

import torch

from autopar.placement import fmt_spec
from autopar.errors import CheckpointError


class RefuseDCP:
    """Raises when DCP asks a local piece to describe itself as a global tensor."""

    def __init__(self, name: str, spec_text: str):
        self.name, self.spec_text = name, spec_text

    def __call__(self, *args, **kwargs):
        raise CheckpointError(
            f"torch.distributed.checkpoint was given {self.name!r} from a rank module's plain "
            f"state_dict(): it is this rank's piece (layout {self.spec_text}), not the whole tensor, and "
            "DCP would save or load it as if it were. Use model_sd, optim_sd = ap.get_state_dict(module, "
            "optimizer) for dcp.save / dcp.load, then ap.set_state_dict(module, optimizer, "
            "model_state_dict=model_sd, optim_state_dict=optim_sd)."
        )


class SizeForDCP:
    """``size()`` of a tagged piece: DCP's load planner asks it first (before any hook), so there
    it refuses; any other caller gets the piece's own size. Holds the shape, not the tensor
    (picklable, no reference cycle)."""

    def __init__(self, refuse: RefuseDCP, shape):
        self.refuse, self.shape = refuse, tuple(shape)

    def __call__(self, dim=None):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            self.refuse()
        size = torch.Size(self.shape)
        return size if dim is None else size[dim]


class StateDictGuard:
    """State-dict hook: tag the split entries (picklable, so modules stay deep-copyable)."""

    def __init__(self, split: dict):
        self.split = split  # serial name -> layout text, for names not replicated everywhere

    def __call__(self, module, state_dict, prefix, local_metadata):
        for key, value in state_dict.items():
            text = self.split.get(key[len(prefix) :] if key.startswith(prefix) else key)
            if text is not None and hasattr(value, "__dict__"):
                refuse = RefuseDCP(key, text)
                value.__create_write_items__ = refuse
                value.__create_chunk_list__ = refuse
                value.size = SizeForDCP(refuse, value.shape)
        return state_dict


def install(module, plan) -> None:
    """Give an emitted rank (or stage) module the guard for ``plan``'s split tensors."""
    split = {n: fmt_spec(s) for n, s in plan.param_specs.items() if not all(p.is_replicate() for p in s)}
    if split:
        module._register_state_dict_hook(StateDictGuard(split))
