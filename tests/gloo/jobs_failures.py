"""gloo jobs for the robustness tests: failing ranks, dead ranks, mismatched plans."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import autopar as ap
from autopar.runtime.backend import current_backend
from tests.harness.models import MLP


def _compiled(timeout, annotations=None, debug=False, hidden=32):
    torch.manual_seed(0)
    model, x = MLP(d=8, hidden=hidden, layers=1), torch.randn(4, 8)
    ann = {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")} if annotations is None else annotations
    module = ap.parallelize(
        model, ap.Mesh((dist.get_world_size(),), ("tp",)), args=(x,), annotations=ann, timeout=timeout, debug=debug
    )
    return module, x


def one_rank_fails(how: str, timeout: float):
    """Rank 1 raises (or exits) before the first forward's all-reduce; rank 0 runs it and
    fails with a CollectiveError naming rank 1 (the pool reports both ranks)."""
    module, x = _compiled(60.0)  # compile waits for the slower rank's tracing: be generous there
    current_backend().timeout = timeout  # then bound the step's collectives tightly
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        raise ValueError("boom on rank 1")
    module(x)
    return "no error"


def debug_checks():
    """World size != mesh size; mismatched plans caught by debug=True; matching plans pass."""
    out = {"mesh": mesh_mismatch()}
    ann = {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")}
    if dist.get_rank() == 1:
        ann = {"layers.*.fc1": ap.rowwise("tp")}
    try:
        _compiled(timeout=60.0, annotations=ann, debug=True)
        out["mismatch"] = "no error"
    except ap.InconsistentPlanError as e:
        out["mismatch"] = str(e)
    module, x = _compiled(timeout=60.0, debug=True)
    out["consistent"] = tuple(module(x).shape)
    return out


def mesh_mismatch():
    """A mesh that does not match the world size."""
    try:
        ap.parallelize(MLP(d=8, hidden=16, layers=1), ap.Mesh((4,), ("tp",)), args=(torch.randn(4, 8),))
    except ap.MeshError as e:
        return str(e)
    return "no error"
