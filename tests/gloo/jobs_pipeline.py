"""Pipeline jobs for the gloo pools (gloo/test_pipeline.py); each worker runs a job as its rank."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar as ap
from autopar.parallel.pipeline import with_pipeline
from autopar.placement import shard_tensor
from tests.harness.distributed import merged_parameters
from tests.harness.meshes import MeshSpec
from tests.harness.models import MEGATRON, gpt_batch, gpt_plan, mse, skipnet_plan, small_gpt
from tests.harness.serial import grad_errors, max_rel_diff, serial_step


def _gpt_plan(shape, axes, dp, layers=4, rows=8):
    batch = gpt_batch(batch=rows)
    plan = gpt_plan(
        MeshSpec(shape, axes, dp),
        model=small_gpt(layers=layers),
        batch=batch,
        pipeline=ap.Pipeline("pp", microbatches=4),
    )
    return plan.model, plan, batch


def gpt_pipeline_matches_serial(shape, axes, dp, configs, rows=8):
    """For each (schedule, chunks, checkpoint): one real step on a batch of ``rows`` in 4
    micro-batches; returns losses and gradient errors."""
    rank = dist.get_rank()
    model, plan, batch = _gpt_plan(shape, axes, dp, rows=rows)
    serial_loss, serial_grads = serial_step(model, batch)
    out = []
    for schedule, chunks, ckpt in configs:
        p = with_pipeline(plan, ap.Pipeline("pp", microbatches=4, schedule=schedule, chunks=chunks, checkpoint=ckpt))
        runner = p.pipeline_runner(rank)
        loss = runner.step(batch)
        out.append(
            {
                "config": (schedule, chunks, ckpt),
                "loss": loss.item(),
                "serial": serial_loss.item(),
                "errors": grad_errors(p, rank, runner, serial_grads),
                "names": sorted(runner.params),
                "stats": runner.stats,
            }
        )
    return out


def gpt_pipeline_sgd(shape, axes, dp, steps=2, lr=0.1):
    """Two SGD steps with the runner's parameters; returns the loss curve and serial's, and the
    worst relative difference of this rank's pieces and of every rank's merged from serial's."""
    rank = dist.get_rank()
    model, plan, _ = _gpt_plan(shape, axes, dp)
    serial = copy.deepcopy(model)
    runner = plan.pipeline_runner(rank)
    opt = torch.optim.SGD(runner.parameters(), lr=lr)
    sopt = torch.optim.SGD(serial.parameters(), lr=lr)
    losses, serial_losses = [], []
    for step in range(steps):
        batch = gpt_batch(batch=8, seed=step + 10)
        losses.append(runner.step(batch).item())
        opt.step()
        opt.zero_grad()
        _, sl = serial(*batch)
        sl.backward()
        sopt.step()
        sopt.zero_grad()
        serial_losses.append(sl.item())
    worst = 0.0
    named = dict(serial.named_parameters(remove_duplicate=False))
    for name, p in runner.params.items():
        if isinstance(p, nn.Parameter):
            ref = shard_tensor(named[name].detach(), plan.param_specs[name], plan.mesh, rank)
            worst = max(worst, ((p.detach() - ref).abs().max() / ref.abs().max()).item())
    # the stages' parameters merged into the serial state (a KeyError before issue 40: each stage
    # holds its own parameters, and the tied weight under its own name)
    merged = max_rel_diff(merged_parameters(runner), dict(serial.named_parameters()))
    return {"losses": losses, "serial": serial_losses, "max_rel_param": worst, "max_rel_merged": merged}


def skipnet_matches_serial():
    """SkipNet on 4 real ranks: skips over stages, a bool mask and two tensors at once."""
    rank = dist.get_rank()
    plan, x, y = skipnet_plan()
    model = plan.model
    serial_loss, serial_grads = serial_step(model, (x,), mse, y)
    runner = plan.pipeline_runner(rank)
    loss = runner.step((x,), y)
    errors = grad_errors(plan, rank, runner, serial_grads)
    # Another batch size: boundary shapes change between steps (each step's first message of a
    # value carries its shape; the later ones are received into buffers posted ahead).
    x2, y2 = torch.randn(12, 16), torch.randn(12, 16)
    runner.holder.zero_grad(set_to_none=True)
    loss2 = runner.step((x2,), y2)
    serial2, grads2 = serial_step(model, (x2,), mse, y2)
    return {
        "loss": loss.item(),
        "serial": serial_loss.item(),
        "loss2": loss2.item(),
        "serial2": serial2.item(),
        "errors": errors + grad_errors(plan, rank, runner, grads2),
    }


def steady_state_messages():
    """1F1B on 2 real ranks, four steps (batch shapes A, A, B, A): each step's point-to-point
    calls counted by kind, and its loss against serial. Only a stream's first message ever
    carries a shape header: from a step whose shapes were seen before, no header and no
    blocking receive (every receive posted ahead)."""
    from autopar.parallel.pipeline import p2p

    rank = dist.get_rank()
    model, plan, batch = _gpt_plan((2,), ("pp",), None)
    runner = plan.pipeline_runner(rank)
    counts, real = [], {k: getattr(p2p.dist, k) for k in ("isend", "irecv", "recv")}

    def counting(kind):
        def call(tensor, *args, tag=0, **kw):
            step[f"{kind}_{'header' if tag % 2 == 0 else 'data'}"] += 1
            return real[kind](tensor, *args, tag=tag, **kw)

        return call

    other = gpt_batch(batch=4, seed=5)
    out = []
    try:
        for k in real:
            setattr(p2p.dist, k, counting(k))
        for b in (batch, gpt_batch(batch=8, seed=2), other, batch):
            step = {f"{k}_{w}": 0 for k in real for w in ("header", "data")}
            loss = runner.step(b)
            runner.holder.zero_grad(set_to_none=True)
            with torch.no_grad():
                serial = model(*b)[1]
            counts.append(step)
            out.append((loss.item(), serial.item()))
    finally:
        for k, fn in real.items():
            setattr(p2p.dist, k, fn)
    return {"counts": counts, "losses": out}


def gpt_zero_bubble_adamw(
    zero: int, steps: int = 3, schedule: str = "zb-h1", shape=(2, 2), axes=("dp", "pp"), checkpoint: bool = True
):
    """``schedule`` (ZB-H1 by default, a V-shaped one on two chunks per rank) on the mesh
    ``shape`` x ``axes`` (dp2 x pp2 by default; Megatron's tp inside the stages where it has a tp
    axis) with ZeRO ``zero`` on its dp axis: ``steps`` AdamW steps of the runner
    (ap.Optimizer) and of the serial model; returns the losses, the first step's gradient errors
    (before its optimizer step) and the worst parameter difference from serial at the end."""
    rank = dist.get_rank()
    chunks = 2 if schedule in ("zbv", "dualpipev") else 1
    pp = shape[axes.index("pp")]
    model = small_gpt(layers=4 * chunks)
    plan = ap.plan(
        copy.deepcopy(model),
        ap.Mesh(shape, axes),
        args=gpt_batch(batch=8),
        annotations=MEGATRON if "tp" in axes else {},
        data_parallel=ap.DataParallel("dp", zero=zero) if "dp" in axes else None,
        pipeline=ap.Pipeline(
            "pp",
            microbatches=max(4, 2 * pp) if schedule == "dualpipev" else 4,
            schedule=schedule,
            chunks=chunks,
            checkpoint=checkpoint,
        ),
    )
    runner = plan.pipeline_runner(rank)
    adamw = dict(lr=0.01, eps=1e-4)  # eps: the key bias's gradient is float noise (see the simulated test)
    opt, sopt = ap.Optimizer(runner, torch.optim.AdamW, **adamw), torch.optim.AdamW(model.parameters(), **adamw)
    losses, serial_losses, errors = [], [], []
    for step in range(steps):
        batch = gpt_batch(batch=8, seed=step)
        losses.append(runner.step(batch).item())
        sl = model(*batch)[1]
        sl.backward()
        serial_losses.append(sl.item())
        if step == 0 and zero < 2:  # ZeRO-2 keeps reduced slices: the parameters below check it
            errors = grad_errors(
                plan, rank, runner, {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}, rtol=1e-4
            )
        opt.step()
        opt.zero_grad()
        sopt.step()
        sopt.zero_grad()
    ref = plan.shard_state_dict({n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, rank)
    # ZeRO-3 leaves some ranks an empty piece of a small parameter: nothing to compare there
    worst = max((p.detach() - ref[n]).abs().max().item() for n, p in runner.named_parameters() if p.numel())
    return {"losses": losses, "serial": serial_losses, "errors": errors, "max_param_diff": worst}
