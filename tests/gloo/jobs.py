"""Jobs for gloo/test_compile.py and gloo/test_bench.py (each worker runs the job as its rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from tests.harness.distributed import merged_parameters, train_beside_serial
from tests.harness.models import MEGATRON, gpt_batch, small_gpt
from tests.harness.serial import max_rel_diff


def gpt_step_matches_serial(shape, axes, dp, steps=3, lr=0.2):
    """Train the GPT with ap.parallelize on every rank, each rank initialised differently.

    Checks that replicated parameters were broadcast (equal on every rank at start), then
    trains the serial model from the merged initial state; returns both loss curves and the
    worst relative parameter difference after training."""
    rank = dist.get_rank()
    model = small_gpt(tied=True, seed=rank + 100)
    mesh = ap.Mesh(shape, axes)
    idx, tg = gpt_batch()
    ann = MEGATRON if "tp" in axes else {}
    module = ap.parallelize(model, mesh, args=(idx, tg), annotations=ann, data_parallel=dp)
    plan = module.autopar_plan
    pieces = {n: p.detach().clone() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    for name, spec in plan.param_specs.items():
        if all(p.is_replicate() for p in spec) and name in gathered[0]:
            assert all(torch.equal(g[name], gathered[0][name]) for g in gathered), f"{name} not broadcast"
    start = plan.merge_state_dicts(gathered)
    serial = small_gpt(tied=True)
    serial.load_state_dict(start, strict=False)
    pairs = train_beside_serial(module, serial, [gpt_batch(seed=step + 10) for step in range(steps)], lr)
    worst = max_rel_diff(merged_parameters(module), dict(serial.named_parameters()))
    return {"losses": [p[0] for p in pairs], "serial": [p[1] for p in pairs], "max_rel_param": worst}


def compile_with_wrong_mesh():
    try:
        ap.parallelize(small_gpt(), ap.Mesh((3,), ("tp",)), args=gpt_batch())
    except ap.MeshError as e:
        return str(e)
    return "no error"


def device_mesh_round_trip(shape, axes):
    mesh = ap.Mesh(shape, axes)
    dm = mesh.to_device_mesh()
    back = ap.Mesh.from_device_mesh(dm)
    return back == mesh, dm.get_group(axes[-1]).size()


def world_info():
    return dist.get_rank(), dist.get_world_size()
