"""gloo jobs for issue 32's user paths: ranks that planned differently, true failure messages."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.runtime.backend import current_backend
from tests.harness.models import MLP

TP = {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")}


def plans_differ(how: str):
    """Rank 1 plans another model config ("config") or other annotations ("annotations"),
    without debug=True: every rank must raise InconsistentPlanError (none aborts)."""
    torch.manual_seed(0)
    hidden = 64 if how == "config" and dist.get_rank() == 1 else 32
    ann = {"layers.*.fc1": ap.rowwise("tp")} if how == "annotations" and dist.get_rank() == 1 else TP
    model, x = MLP(d=8, hidden=hidden, layers=1), torch.randn(4, 8)
    try:
        ap.parallelize(model, ap.Mesh((dist.get_world_size(),), ("tp",)), args=(x,), annotations=ann, timeout=60.0)
    except ap.InconsistentPlanError as e:
        return str(e)
    return "no error"


def failure_after(timeout: float):
    """Rank 1 exits before the first forward's all-reduce: rank 0's message must say how long it
    really waited (and the timeout apart), not 'after waiting up to <timeout> s'."""
    import os

    torch.manual_seed(0)
    model, x = MLP(d=8, hidden=32, layers=1), torch.randn(4, 8)
    module = ap.parallelize(model, ap.Mesh((dist.get_world_size(),), ("tp",)), args=(x,), annotations=TP, timeout=60.0)
    current_backend().timeout = timeout
    if dist.get_rank() == 1:
        os._exit(3)
    module(x)  # raises CollectiveError (the pool reports it with rank 1's death)
    return "no error"
