"""Gloo job for gloo/test_comm_bytes.py: planned bytes vs what DistBackend sends."""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist

import autopar as ap
from autopar.runtime.backend import current_backend
from tests.harness.comm import RING, ByteCounter
from tests.harness.models import MEGATRON, gpt_batch, small_gpt


def gpt_bytes_planned_and_sent():
    """One forward+backward of the GPT on (dp=2, tp=2): {(axis, kind): bytes} planned and sent."""
    mesh = ap.Mesh((2, 2), ("dp", "tp"))
    idx, tgt = gpt_batch(batch=8, seq=8)
    module = ap.parallelize(small_gpt(), mesh, args=(idx, tgt), annotations=MEGATRON, data_parallel="dp")
    plan, rank = module.autopar_plan, dist.get_rank()
    backend = current_backend()
    backend.stats = ByteCounter()  # after compile's start-up broadcasts
    args, kwargs = plan.local_inputs(rank, idx, tgt)
    module(*args, **kwargs)[1].backward()
    backend.stats, rows = None, backend.stats.rows
    axis_of = {g: mesh.axis_names[a] for a in range(mesh.ndim) for g in mesh.groups(a)}
    sent = defaultdict(float)
    for kind, group, nbytes in rows:
        sent[(axis_of[group], kind)] += RING[kind](len(group)) * nbytes
    planned = defaultdict(float)
    for c in plan.collectives():
        planned[(c.axis, c.kind)] += c.bytes
    return dict(planned), dict(sent)
