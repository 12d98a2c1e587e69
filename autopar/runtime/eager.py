"""``eager``: ``torch.compiler.disable`` without importing torch._dynamo when autopar is imported.

``@torch.compiler.disable`` on a module-level function imports torch._dynamo (and with it
inductor's config, FSDP1 and DTensor's op strategies: about 1 s here) the moment the module is
imported, on every rank and in every process, compiled or not. ``eager`` is torch's own lazy
form of it (``torch._disable_dynamo``, torch/_compile.py): torch._dynamo is imported at the
first call; under torch.compile the function runs eagerly, one graph break per call site, as
with the decorator (the break reads "function marked as skipped", torch/_compile.py).

Example:
    >>> @eager
    ... def count_rows(x): return float(x.shape[0])    # a Python number, not a value to trace
"""

from __future__ import annotations

import sys

import torch


def eager(fn):
    """``fn`` run eagerly under torch.compile (see the module docstring); works on methods too."""
    if "torch._dynamo" in sys.modules:  # already paid for: the plain decorator
        return torch.compiler.disable(fn)
    # torch's own lazy form of the decorator (torch/_compile.py): dynamo imported at the first call
    return torch._disable_dynamo(fn)
