"""``eager``: ``torch.compiler.disable`` without importing torch._dynamo when autopar is imported.

``@torch.compiler.disable`` on a module-level function imports torch._dynamo (and with it
inductor's config, FSDP, DTensor's op strategies and sympy: about 2 s) the moment the module
is imported, on every rank and in every process, compiled or not. Nothing can be compiling
before torch._dynamo is imported, so ``eager(fn)`` calls ``fn`` directly until then, and the
disabled function (made once) after: under torch.compile it runs eagerly, a graph break, as
with the decorator.

Example:
    >>> @eager
    ... def count_rows(x): return float(x.shape[0])    # a Python number, not a value to trace
"""

from __future__ import annotations

import functools
import sys

import torch


def eager(fn):
    """``fn`` run eagerly under torch.compile (see the module docstring); works on methods too."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # nothing compiles without it
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call
