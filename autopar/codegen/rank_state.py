"""Moving tensors between the serial model's names and each rank's pieces.

Example:
    >>> pieces = [shard_state(full, specs, mesh, r) for r in mesh.ranks()]
    >>> merged = merge_states(pieces, specs, mesh)        # equal to full again
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.errors import InputError, close_matches
from autopar.placement import merge_tensors, shard_tensor


def merge_states(per_rank: list[dict], specs: dict, mesh) -> dict:
    """Full serial tensors from per-rank dicts (parameters, gradients or buffers)."""
    if len(per_rank) != mesh.size:
        raise InputError(f"merge_state_dicts got {len(per_rank)} dicts; the mesh {mesh} has {mesh.size} ranks.")
    out = {}
    for key in per_rank[0]:
        if key not in specs:
            raise InputError(
                f"merge_state_dicts: {key!r} is not a parameter or buffer of the plan; "
                f"did you mean {close_matches(key, specs)}?"
            )
        pieces = [d[key] for d in per_rank]
        if any(p is None for p in pieces):
            out[key] = None
            continue
        out[key] = merge_tensors([p.detach() for p in pieces], specs[key], mesh)
    return out


def shard_state(full: dict, specs: dict, mesh, rank: int) -> dict:
    """This rank's pieces of a full serial state dict (cloned, contiguous)."""
    out = {}
    for key, value in full.items():
        if key not in specs:
            raise InputError(
                f"shard_state_dict: {key!r} is not a parameter or buffer of the plan; "
                f"did you mean {close_matches(key, specs)}?"
            )
        out[key] = shard_tensor(value.detach(), specs[key], mesh, rank).clone()
    return out


def set_attr(root: nn.Module, fqn: str, value, persistent: bool = True) -> None:
    """root.a.b.c = value, creating plain submodules on the way; parameters and buffers registered."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor) and persistent is not None:
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        setattr(mod, leaf, value)
