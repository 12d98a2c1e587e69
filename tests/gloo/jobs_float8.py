"""gloo jobs for gloo/test_float8.py (each worker runs the job as its rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.placement import shard_tensor
from tests.harness.meshes import MESHES
from tests.harness.models import MLP, MLP_TP


def float8_matches_serial(mesh_name, recipe):
    """ap.Float8 under ap.parallelize: this rank's gradients against the serial torchao model's
    (the amax all-reduces run as torch.distributed MAX all-reduces)."""
    import torchao.float8 as f8

    spec, rank = MESHES[mesh_name], dist.get_rank()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 16, generator=g)
    x[1, 5] = 40.0  # on dp rank 0 only
    torch.manual_seed(0)
    module = ap.parallelize(
        MLP(),
        spec.mesh(),
        args=(x,),
        annotations=MLP_TP if "tp" in spec.axes else {},
        data_parallel=spec.dp,
        float8=ap.Float8(recipe),
    )
    plan = module.autopar_plan
    (a,), _ = plan.local_inputs(rank, x)
    module(a).sin().square().mean().backward()  # test_float8.py's loss (see docs/float8.md: tolerances)
    torch.manual_seed(0)
    serial = f8.convert_to_float8_training(MLP(), config=f8.Float8LinearConfig.from_recipe_name(recipe))
    serial(x).sin().square().mean().backward()
    named = dict(serial.named_parameters())
    worst = 0.0
    for n, p in module.named_parameters():
        ref = shard_tensor(named[n].grad, plan.param_specs[n], plan.mesh, rank)
        worst = max(worst, ((p.grad - ref).abs().max() / named[n].grad.abs().max()).item())
    return worst
