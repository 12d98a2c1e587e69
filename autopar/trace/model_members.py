"""A model's named parameters and modules, read once while planning cannot change them.

``model.named_parameters()`` walks every module each time: on a 126-block model that is a few
milliseconds, and the search's ~40 probe plans asked it a few hundred times (a sixth of a
512-rank search). Inside ``held(model)`` (the planner holds the model through the search, which
plans probes and changes no module) the walk is done once and its list given back after;
outside, it is the walk.

Example:
    >>> with held(model):
    ...     params = dict(named_parameters(model))   # walked once inside the block
"""

from __future__ import annotations

import contextlib
import contextvars

from torch import nn

_HELD: contextvars.ContextVar = contextvars.ContextVar("autopar_held_model", default=None)


@contextlib.contextmanager
def held(model: nn.Module):
    """Within the block, ``named_parameters(model)`` and ``named_modules(model)`` read ``model``
    once: the caller promises not to add, remove or replace its modules and parameters there."""
    token = _HELD.set((model, {}))
    try:
        yield
    finally:
        _HELD.reset(token)


@contextlib.contextmanager
def released():
    """Within the block nothing is held: tracing swaps modules and parameters for stand-ins
    (a truncated stack, meta parameters in another dtype) while it runs."""
    token = _HELD.set(None)
    try:
        yield
    finally:
        _HELD.reset(token)


def named_parameters(model: nn.Module) -> tuple:
    """``tuple(model.named_parameters())``, walked once per ``held`` block."""
    return _members(model, "parameters", lambda: tuple(model.named_parameters()))


def named_modules(model: nn.Module) -> tuple:
    """``tuple(model.named_modules())``, walked once per ``held`` block."""
    return _members(model, "modules", lambda: tuple(model.named_modules()))


def _members(model, kind: str, walk) -> tuple:
    found = _HELD.get()
    if found is None or found[0] is not model:
        return walk()
    cache = found[1]
    if kind not in cache:
        cache[kind] = walk()
    return cache[kind]
