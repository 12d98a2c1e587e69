"""Memory per rank: parameter bytes vs serial / tp, and the peak bytes a training step allocates.

One rank's module runs alone in this process with a shape-only backend (collectives return
tensors of the right shape, no communication: memory is what the real run allocates, the
values are not). Allocations are counted by autopar/runtime/live_bytes.LiveBytes, a dispatch
mode that sees every storage an op creates, forward and backward, until it dies; the peak over
the step (activations kept for backward, gradients, temporaries) is reported. The counter only
observes, so the rank module keeps its eager fast paths (in-place all-reduce, aliasing
identities) as in an unobserved run. tp = 1 is the serial model under the same counter.

Example:
    >>> rows = run(quick=True)
"""

from __future__ import annotations

import torch

import autopar as ap
from autopar.runtime.live_bytes import LiveBytes
from autopar.runtime.backend import use_backend
from autopar.runtime.pieces import _pos, all_to_all_local, chunk_of
from bench.common import row
from bench.models import annotations, build, loss_of


class ShapeBackend:
    """Collectives with real output shapes and no communication (this rank's values stand in)."""

    stats = None
    supports_in_place = True

    def all_reduce_(self, x, group, rank, op):
        return x

    def all_reduce(self, x, group, rank, op):
        return x.contiguous().clone()

    def all_gather(self, x, dim, group, rank):
        return torch.cat([x] * len(group), dim=dim)

    def reduce_scatter(self, x, dim, group, rank, op):
        return chunk_of(x, dim, len(group), _pos(group, rank)).clone()

    def all_to_all(self, x, src_dim, dst_dim, group, rank):
        return all_to_all_local([x] * len(group), src_dim, dst_dim, _pos(group, rank)).contiguous()


def step_peak(module, args) -> int:
    """Peak bytes allocated by one forward + backward of ``module`` (gradients dropped before)."""
    for p in module.parameters():
        p.grad = None
    with LiveBytes() as mem:
        loss_of(module(*args)).backward()
    peak = mem.peak
    for p in module.parameters():
        p.grad = None
    return peak


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def measure(kind: str, size: str, tps=(1, 2, 4)) -> list[dict]:
    model, args = build(kind, size)
    serial_params, serial_peak = param_bytes(model), step_peak(model, args)
    rows = []
    for tp in tps:
        if tp == 1:
            pb, peak = serial_params, serial_peak
        else:
            plan = ap.plan(model, ap.Mesh((tp,), ("tp",)), args=args, annotations=annotations(kind))
            module = plan.build_module(0)
            with use_backend(ShapeBackend()):
                pb, peak = param_bytes(module), step_peak(module, plan.local_inputs(0, *args)[0])
        case = f"{kind} {size}, tp={tp}"
        rows += [
            row(
                "memory",
                case,
                "param MiB per rank",
                round(pb / 2**20, 3),
                "",
                f"serial/tp {serial_params / tp / 2**20:.3f} MiB; ratio {pb / (serial_params / tp):.2f}",
            ),
            row(
                "memory",
                case,
                "peak step MiB per rank",
                round(peak / 2**20, 3),
                "",
                f"serial {serial_peak / 2**20:.3f} MiB; ratio to serial/tp {peak / (serial_peak / tp):.2f}",
            ),
        ]
    return rows


def run(quick: bool) -> list[dict]:
    cases = [("gpt", "tiny")] if quick else [("gpt", "large"), ("mlp", "large")]
    return [r for kind, size in cases for r in measure(kind, size, (1, 2) if quick else (1, 2, 4))]
