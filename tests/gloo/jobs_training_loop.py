"""gloo jobs for the training-loop contracts (tests/gloo/test_training_loop.py): torch.compile,
dropout and fp16 loss scaling (ap.GradScaler) on real processes, against the serial model trained
in the same process."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from tests.harness.models import MEGATRON, MLP, MLP_TP, gpt_batch, small_gpt
from tests.simulated.test_training_loop import ANN, Net


def compiled_gpt_matches_serial(shape, axes, dp, steps=3):
    """The issue's reproduction: tp GPT under torch.compile (inductor), the same batch called
    three times, then SGD steps; losses and parameters against serial."""
    torch.manual_seed(0)
    model = small_gpt()
    mesh = ap.Mesh(shape, axes)
    idx, tg = gpt_batch()
    module = ap.parallelize(model, mesh, args=(idx, tg), annotations=MEGATRON, data_parallel=dp)
    plan, rank = module.autopar_plan, dist.get_rank()
    serial = small_gpt()
    serial.load_state_dict(model.state_dict())
    run = torch.compile(module)
    args, _ = plan.local_inputs(rank, idx, tg)
    repeated = [run(*args)[1].item() for _ in range(3)]
    opt, sopt = torch.optim.SGD(module.parameters(), lr=0.2), torch.optim.SGD(serial.parameters(), lr=0.2)
    losses, serial_losses = [], []
    for step in range(steps):
        idx, tg = gpt_batch(seed=step + 10)
        args, _ = plan.local_inputs(rank, idx, tg)
        loss = run(*args)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        sl = serial(idx, tg)[1]
        sl.backward()
        sopt.step()
        sopt.zero_grad()
        losses.append(loss.item())
        serial_losses.append(sl.item())
    return {
        "repeated": repeated,
        "losses": losses,
        "serial": serial_losses,
        "max_rel_param": _max_rel(plan, module, serial),
    }


def dropout_training_matches_serial(shape, axes, dp, rng, steps=3):
    """Net with dropout on split and replicated tensors, SGD steps. rng="serial": parameters equal
    serial's; both modes: replicated parameters stay equal on every rank."""
    torch.manual_seed(0)
    model, x = Net(0.4), torch.randn(8, 16)
    serial = Net(0.4)
    serial.load_state_dict(model.state_dict())
    module = ap.parallelize(
        model, ap.Mesh(shape, axes), args=(x,), annotations=ANN, data_parallel=dp, rng=rng, seed=dist.get_rank() + 11
    )  # different seeds: compile makes them agree
    plan, rank = module.autopar_plan, dist.get_rank()
    opt, sopt = torch.optim.SGD(module.parameters(), lr=0.1), torch.optim.SGD(serial.parameters(), lr=0.1)
    for step in range(steps):
        if rng == "serial":
            ap.manual_seed(module, step)
        torch.manual_seed(step)
        xs = torch.randn(8, 16)
        (xl,), _ = plan.local_inputs(rank, xs)
        module(xl).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(step)
        serial(xs).pow(2).mean().backward()
        sopt.step()
        sopt.zero_grad()
    pieces = {n: p.detach().clone() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    replicas_equal = all(
        torch.equal(g[n], gathered[0][n])
        for g in gathered
        for n, spec in plan.param_specs.items()
        if all(p.is_replicate() for p in spec) and n in g
    )
    return {"replicas_equal": replicas_equal, "max_rel_param": _max_rel(plan, module, serial)}


def _max_rel(plan, module, serial):
    pieces = {n: p.detach().clone() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    merged = plan.merge_state_dicts(gathered)
    return max(
        ((merged[n] - p.detach()).abs().max() / p.abs().max()).item()
        for n, p in serial.named_parameters()
        if n in merged
    )


def grad_scaler_agrees(shape, axes, zero):
    """fp16 autocast with ap.GradScaler: two clean steps against serial torch.amp.GradScaler, then
    a step with an inf in rank 0's first stepped gradient only: every rank skips and halves its
    scale. Returns the scales, the distance from serial after the clean steps and how far this
    rank's weights moved in the skipped step."""
    from autopar.parallel.grad_scaler import stepped_tensors

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    serial = MLP()
    serial.load_state_dict(model.state_dict())
    dp = ap.DataParallel("dp", zero=zero) if "dp" in axes else None
    ann = MLP_TP if "tp" in axes else {}
    module = ap.parallelize(model, ap.Mesh(shape, axes), args=(x,), annotations=ann, data_parallel=dp)
    plan, rank = module.autopar_plan, dist.get_rank()
    opt = ap.ZeroOptimizer(module, torch.optim.SGD, lr=0.1) if zero else torch.optim.SGD(module.parameters(), lr=0.1)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.1)
    scaler, sscaler = ap.GradScaler(module, init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    (xl,), _ = plan.local_inputs(rank, x)
    scales, serial_scales, moved = [], [], 0.0
    for step in range(3):
        before = [p.detach().clone() for p in module.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            out = module(xl)
        scaler.scale(out.float().square().mean()).backward()
        if step == 2 and rank == 0:
            next(t for t in stepped_tensors(opt) if t.grad is not None).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if step == 2:
            moved = max((p - b).abs().max().item() for p, b in zip(module.parameters(), before))
            break
        with torch.autocast("cpu", dtype=torch.float16):
            sout = serial(x)
        sscaler.scale(sout.float().square().mean()).backward()
        sscaler.step(sopt)
        sscaler.update()
        sopt.zero_grad()
        serial_scales.append(sscaler.get_scale())
        if step == 1:
            max_rel = _max_rel(plan, module, serial)
    return {"scales": scales, "serial_scales": serial_scales, "max_rel_param": max_rel, "moved": moved}


def plain_grad_scaler_refused(shape, axes):
    """torch.amp.GradScaler stepping a tp rank module's optimizer: the PlanError's text on each rank."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    module = ap.parallelize(model, ap.Mesh(shape, axes), args=(x,), annotations=MLP_TP)
    (xl,), _ = module.autopar_plan.local_inputs(dist.get_rank(), x)
    opt, scaler = torch.optim.SGD(module.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(module(xl).square().mean()).backward()
    try:
        scaler.step(opt)
    except ap.PlanError as err:
        return str(err)
    return None
