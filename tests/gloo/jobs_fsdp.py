"""gloo jobs for the fully sharded data-parallel tests (each worker runs the job as its rank)."""

from __future__ import annotations

import torch.distributed as dist

import autopar as ap
from autopar.api import parallelize  # ap.parallelize once exported
from tests.harness import data_parallel as H
from tests.harness.meshes import MESHES
from tests.harness.models import MLP_TP
from tests.harness.serial import max_rel_diff


def three_steps(mesh_name, options):
    """3 AdamW steps of ap.parallelize(zero=3) on real processes; rank 0 returns the worst
    relative difference from serial and every rank the number of parameter elements it holds."""
    spec = MESHES[mesh_name]
    ann = MLP_TP if "tp" in spec.axes else {}
    module = parallelize(
        H.make_model(),
        spec.mesh(),
        args=(H.batches(1)[0],),
        annotations=ann,
        data_parallel=ap.DataParallel("dp", zero=3, **options),
    )
    plan, rank = module.autopar_plan, dist.get_rank()
    mine = H.train_rank(plan, rank, "adamw")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    held = sum(p.numel() for p in module.parameters())
    if rank != 0:
        return None, held
    return max_rel_diff(plan.merge_state_dicts(gathered), H.train_serial("adamw")), held
