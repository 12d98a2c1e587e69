"""gloo jobs for the input-gradient contract (issue 31): each worker runs the job as its rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.placement import Replicate, Shard, shard_tensor


class ScaledLinear(nn.Module):
    """linear(x * scale, weight, bias): every input but ``x`` requires grad, as a soft prompt or a
    weight passed as an input would."""

    def forward(self, x, scale, weight, bias):
        return F.linear(x * scale, weight, bias).tanh()


def replicated_input_gradients(shape, axes, dp):
    """Each rank's gradient of every input against its piece of the serial one: (name, max |diff|)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=gen)
    others = [torch.randn(s, generator=gen).requires_grad_() for s in ((6,), (5, 6), (5,))]
    mesh = ap.Mesh(tuple(shape), tuple(axes))
    whole = ap.place(*[Replicate()] * mesh.ndim)
    ann = {"scale": whole, "weight": whole, "bias": whole}  # data parallel would split their dim 0
    if not dp:
        ann["x"] = ap.place(*([Shard(0)] + [Replicate()] * (mesh.ndim - 1)))
    module = ap.parallelize(ScaledLinear(), mesh, args=(x, *others), annotations=ann, data_parallel=dp)
    plan = module.autopar_plan
    (lx, *local), _ = plan.local_inputs(rank, x, *others)
    leaves = [t.detach().clone().requires_grad_() for t in local]
    out = module(lx, *leaves)
    out.sum().backward()
    serial_others = [t.detach().clone().requires_grad_() for t in others]
    # a batch-split output's gradient is scaled by 1/dp on each rank (the DDP convention)
    batch_split = dp is not None and isinstance(plan.output_specs[0][0], Shard)
    (ScaledLinear()(x, *serial_others).sum() / (mesh.shape[0] if batch_split else 1)).backward()
    worst = []
    for name, leaf, ser, spec in zip(("scale", "weight", "bias"), leaves, serial_others, plan.input_specs[1:]):
        expected = shard_tensor(ser.grad, spec, mesh, rank)
        worst.append((name, (leaf.grad - expected).abs().max().item()))
    return worst
