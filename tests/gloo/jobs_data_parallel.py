"""gloo jobs for the data-parallel tests (each worker runs the job as its rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.runtime.backend import current_backend, use_backend
from tests.harness import data_parallel as H
from tests.harness.comm import Recorder
from tests.harness.meshes import MESHES
from tests.harness.serial import max_rel_diff


def _compiled_plan(mesh_name, seed_per_rank=False, zero=0):
    spec = MESHES[mesh_name]
    model = H.make_model(seed=100 + dist.get_rank() if seed_per_rank else 0)
    ann = H.MLP_TP if "tp" in spec.axes else {}
    module = ap.parallelize(
        model,
        spec.mesh(),
        args=(H.batches(1)[0],),
        annotations=ann,
        data_parallel=ap.DataParallel("dp", zero=zero, bucket_max_params=3),
    )
    return module, module.autopar_plan


def numerics(mesh_name, options):
    """Every option x optimizer for STEPS steps; rank 0 returns the worst relative difference."""
    rank = dist.get_rank()
    _, plan = _compiled_plan(mesh_name)
    out = {}
    for option in options:
        p = plan.with_data_parallel(ap.DataParallel("dp", **H.OPTIONS[option]))
        for opt_name in H.OPTIMIZERS:
            mine = H.train_rank(p, rank, opt_name)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                out[(option, opt_name)] = max_rel_diff(p.merge_state_dicts(gathered), H.reference(p, opt_name))
    return out


def calls(mesh_name, option):
    """One training step recorded: this rank's collectives (kind, group, numel) in order."""
    _, plan = _compiled_plan(mesh_name)
    p = plan.with_data_parallel(ap.DataParallel("dp", **H.OPTIONS[option]))
    rec = Recorder(current_backend())
    with use_backend(rec):
        H.train_rank(p, dist.get_rank(), "sgd", H.batches(1))
    return rec.calls[dist.get_rank()], len(p.grad_buckets())


def broadcast_from_first_rank(mesh_name, zero=0):
    """Ranks build their models with different seeds; after ap.parallelize every rank holds the
    pieces of the first rank of its dp group (ZeRO: also after a step through the flat shards)."""
    module, plan = _compiled_plan(mesh_name, seed_per_rank=True, zero=zero)
    if zero:
        opt = ap.ZeroOptimizer(module, torch.optim.AdamW, lr=0.01)
        (x,), _ = plan.local_inputs(dist.get_rank(), H.batches(1)[0])
        H.loss_of(module(x)).backward()
        opt.step()
    mine = {n: p.detach().clone() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    first = gathered[plan.mesh.group("dp", dist.get_rank())[0]]
    same_in_group = all(torch.equal(mine[n], first[n]) for n in mine)
    differs_from_own_init = any(
        not torch.equal(mine[n], p.detach())
        for n, p in H.make_model(seed=100 + dist.get_rank()).named_parameters()
        if n in mine and mine[n].shape == p.shape
    )
    return same_in_group, differs_from_own_init or plan.mesh.group("dp", dist.get_rank())[0] == dist.get_rank()


def overlap(mesh_name):
    """The order of events in one backward on this rank: bucket launches (async collectives
    handed to gloo) and the accumulation of the first layer's weight gradient."""
    _, plan = _compiled_plan(mesh_name)
    p = plan.with_data_parallel(ap.DataParallel("dp", bucket_max_params=2))
    rank, events = dist.get_rank(), []
    module = p.build_module(rank)
    module.get_parameter("layers.0.fc1.weight").register_post_accumulate_grad_hook(
        lambda _: events.append(("first layer grad", rank, ""))
    )
    (x,), _ = p.local_inputs(rank, H.batches(1)[0])
    with use_backend(Recorder(current_backend(), events)):
        H.loss_of(module(x)).backward()
    return [e[0] for e in events]
