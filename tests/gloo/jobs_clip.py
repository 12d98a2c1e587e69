"""gloo jobs for ap.clip_grad_norm_ (each worker runs the job as its rank)."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

import autopar as ap
from autopar.placement import shard_tensor
from tests.harness.models import MLP, MLP_TP

LR = 0.5


def _loss(out):
    return out.sin().square().mean() + out.mean()


def clip_step_matches_serial(shape, axes, zero, norm_type):
    """One clipped SGD step on a compiled rank module; returns (total, serial total, max |diff|)."""
    norm_type = math.inf if norm_type == "inf" else norm_type
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    serial = copy.deepcopy(model)
    _loss(serial(x)).backward()
    full = float(torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9, norm_type))
    s_total = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.3 * full, norm_type)
    with torch.no_grad():
        for p in serial.parameters():
            p -= LR * p.grad
    dp = ap.DataParallel("dp", zero=zero, bucket_max_params=3) if "dp" in axes else None
    module = ap.parallelize(
        model,
        ap.Mesh(tuple(shape), tuple(axes)),
        args=(x,),
        annotations=MLP_TP if "tp" in axes else {},
        data_parallel=dp,
    )
    plan, rank = module.autopar_plan, dist.get_rank()
    opt = ap.ZeroOptimizer(module, torch.optim.SGD, lr=LR) if zero else torch.optim.SGD(module.parameters(), lr=LR)
    args, _ = plan.local_inputs(rank, x)
    _loss(module(*args)).backward()
    total = ap.clip_grad_norm_(module, 0.3 * full, norm_type)
    opt.step()
    worst = max(
        (module.get_parameter(n) - shard_tensor(p.detach(), plan.param_specs[n], plan.mesh, rank)).abs().max().item()
        for n, p in serial.named_parameters()
    )
    return float(total), float(s_total), worst
