"""gloo jobs for the fully sharded data-parallel tests (each worker runs the job as its rank)."""

from __future__ import annotations

import torch.distributed as dist

import autopar as ap
from autopar.api import parallelize  # ap.parallelize once exported
from tests.harness import data_parallel as H
from tests.harness.meshes import MESHES
from tests.harness.models import MLP_TP
from tests.harness.serial import max_rel_diff


def three_steps(mesh_name, options, compiled=False):
    """3 AdamW steps of ap.parallelize(zero=3) on real processes (through torch.compile if
    ``compiled``); rank 0 returns the worst relative difference from serial and every rank the
    number of parameter elements it holds."""
    import torch

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
    mine = H.train_rank(plan, rank, "adamw", wrap=torch.compile if compiled else None)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    held = sum(p.numel() for p in module.parameters())
    if rank != 0:
        return None, held
    return max_rel_diff(plan.merge_state_dicts(gathered), H.train_serial("adamw")), held


def hsdp_two_axes():
    """HSDP on a (rep, shard) mesh through ap.parallelize: rank 0 returns the worst relative
    difference from serial after 3 AdamW steps."""
    module = parallelize(
        H.make_model(),
        ap.Mesh((2, 2), ("rep", "shard")),
        args=(H.batches(1)[0],),
        data_parallel=ap.DataParallel("shard", zero=3, replicate_axis="rep"),
    )
    plan, rank = module.autopar_plan, dist.get_rank()
    mine = H.train_rank(plan, rank, "adamw")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return max_rel_diff(plan.merge_state_dicts(gathered), H.train_serial("adamw")) if rank == 0 else None


def pipeline_three_adamw(steps=3, param_dtype=None):
    """(2, 2) pp x dp with zero=3 on real processes: the loss of each of ``steps`` AdamW steps and
    of one more forward (parameters after the last step), with the serial model's (computing in
    ``param_dtype`` from fp32 parameters, as the plan's precision policy does)."""
    import copy

    import torch

    from tests.harness.models import gpt_batch, small_gpt

    model, batch = small_gpt(tied=False, layers=4), gpt_batch()
    plan = ap.plan(
        model,
        ap.Mesh((2, 2), ("pp", "dp")),
        args=batch,
        data_parallel=ap.DataParallel("dp", zero=3, param_dtype=param_dtype),
        pipeline=ap.Pipeline("pp", microbatches=2),
    )
    serial = copy.deepcopy(model)

    def serial_loss():
        low = {n: p.to(param_dtype) if param_dtype else p for n, p in serial.named_parameters()}
        return torch.func.functional_call(serial, low, batch)[1].float()

    runner = plan.pipeline_runner(dist.get_rank())
    opt = ap_adamw(runner.parameters())
    sopt = ap_adamw(serial.parameters())
    losses, ref = [], []
    for _ in range(steps):
        losses.append(runner.step(batch).item())
        opt.step()
        opt.zero_grad()
        loss = serial_loss()
        ref.append(loss.item())
        loss.backward()
        sopt.step()
        sopt.zero_grad()
    losses.append(runner.evaluate(batch).item())
    ref.append(serial_loss().item())
    dense = plan.with_data_parallel("dp").pipeline_runner(dist.get_rank(), distributed=False)
    return losses, ref, sum(p.numel() for p in runner.parameters()), sum(p.numel() for p in dense.parameters())


def ap_adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def against_fsdp2(steps=10):
    """Tiny HF LLaMA, 2 or 4 processes (the pool's), ``steps`` AdamW steps on each rank's share of
    one global batch (2 rows a process): torch FSDP2 (``fully_shard`` per decoder layer and at the
    root, MixedPrecisionPolicy(bf16, reduce fp32)) and ap.parallelize(DataParallel(zero=3,
    param_dtype=bf16, reduce_dtype=fp32)) from the same weights. Returns (FSDP2's losses, ours: each
    the ranks' mean, the largest relative distance of a parameter's total update from FSDP2's, of
    the parameters themselves, and on rank 0 the serial model's run under ``torch.autocast("cpu",
    bf16)`` on the whole batch: its losses and the same two distances of ours from it)."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tests.harness.hf_models import causal_lm, inputs

    bf16, rank, world = torch.bfloat16, dist.get_rank(), dist.get_world_size()
    model, kw = causal_lm("llama", layers=2), inputs("llama", b=2 * world)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = copy.deepcopy(model).train()
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in ref.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(ref, mesh=mesh, mp_policy=policy)
    share = {k: v.chunk(world)[rank] for k, v in kw.items()}
    module = parallelize(
        copy.deepcopy(model).train(),
        ap.Mesh((world,), ("dp",)),
        kwargs=kw,
        data_parallel=ap.DataParallel("dp", zero=3, param_dtype=bf16, reduce_dtype=torch.float32),
    )
    _, local = module.autopar_plan.local_inputs(rank, **kw)
    theirs, ours = [], []
    for net, batch, losses in ((ref, share, theirs), (module, local, ours)):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
        for _ in range(steps):
            loss = net(**batch).loss.float()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # FSDP2's rank holds its share's mean; ours the whole batch's (loss_mean)
            losses.append(mean.item() / world)
    full = {n: p.full_tensor().detach() for n, p in ref.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {n: p.detach() for n, p in module.named_parameters()})
    got = module.autopar_plan.merge_state_dicts(gathered)
    autocast = _autocast_run(copy.deepcopy(model).train(), kw, steps, got, init) if rank == 0 else None
    return theirs, ours, *_distances(got, full, init), autocast


def _distances(got, ref, init):
    """(the largest ||got - ref|| / ||ref - init|| of a parameter: its total update's distance; the
    largest ||got - ref|| / ||ref||: the parameter's)."""
    moved = max(((got[n] - ref[n]).norm() / (ref[n] - init[n]).norm()).item() for n in ref)
    params = max(((got[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
    return moved, params


def _autocast_run(model, kw, steps, got, init):
    """The serial model trained under torch.autocast("cpu", bf16) with the same AdamW steps on the
    whole batch: (its losses, ours' update and parameter distances from it)."""
    import torch

    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**kw).loss.float()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, *_distances(got, {n: p.detach() for n, p in model.named_parameters()}, init)
