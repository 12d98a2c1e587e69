"""Optimizer param groups from parameter-name patterns, the same on every rank: shared by
ap.Optimizer (parallel/optimizer.py) and the optimizer a storage steps its slices with
(ZeRO 1-2's ap.ZeroOptimizer), so that both read ``param_groups=`` alike; and their zero_grad.

Example:
    >>> group_params([("w", w)], [{"params": ["*.bias"], "weight_decay": 0}], ["w", "b.bias"])
    [{'params': [], 'weight_decay': 0}, {'params': [w]}]
"""

from __future__ import annotations

import fnmatch


def group_params(named: list, spec: list[dict], every_name: list[str]) -> list[dict]:
    """Param groups from name patterns: ``spec``'s groups in order, then one for the names that
    match none (only if some name anywhere does). ``named``: (serial name, tensor) this rank
    steps; ``every_name``: the names every rank steps. Every rank gets the same groups, empty
    where it holds none of a group's parameters (a ZeRO slice, a pipeline stage): checkpoints
    match groups by position (ap.set_state_dict) and LR schedulers set them by index, so a
    dropped group would hand its hyperparameters to the next one.

    Example:
        >>> group_params([("w", w)], [{"params": ["*.bias"], "weight_decay": 0}], ["w", "b.bias"])
        [{'params': [], 'weight_decay': 0}, {'params': [w]}]
    """

    def group_of(name: str) -> int:
        return next(
            (j for j, g in enumerate(spec) if any(fnmatch.fnmatch(name, pat) for pat in g["params"])), len(spec)
        )

    out = [dict(g, params=[]) for g in spec] + [{"params": []}]
    for name, t in named:
        out[group_of(name)]["params"].append(t)
    return out if any(group_of(n) == len(spec) for n in every_name) or not spec else out[:-1]


def zero_grads(tensors, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad`` over ``tensors`` (parameters, ZeRO slices): None or zeros in place."""
    for p in tensors:
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
