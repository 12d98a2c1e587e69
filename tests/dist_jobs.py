"""Jobs run by the gloo worker pools (each worker runs the job as its rank)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from tests.models import MEGATRON, gpt_batch, small_gpt


def gpt_step_matches_serial(shape, axes, dp, steps=2, lr=0.1):
    """Train the GPT for ``steps`` SGD steps with ap.compile; return the loss curve and the
    merged-on-rank-0 max difference of every parameter against serial training."""
    rank = dist.get_rank()
    serial = small_gpt(tied=True)
    model = small_gpt(tied=True, seed=rank + 100)  # different init per rank: compile broadcasts
    mesh = ap.Mesh(shape, axes)
    idx, tg = gpt_batch()
    ann = MEGATRON if "tp" in axes else {}
    with torch.no_grad():  # the sharded parameters come from each rank's model: give them serial values
        for p, q in zip(model.parameters(), serial.parameters()):
            p.copy_(q)
    module = ap.compile(model, mesh, args=(idx, tg), annotations=ann, data_parallel=dp)
    plan = module.autopar_plan
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    sopt = torch.optim.SGD(serial.parameters(), lr=lr)
    losses, serial_losses = [], []
    for step in range(steps):
        idx, tg = gpt_batch(seed=step + 10)
        args, kwargs = plan.local_inputs(rank, idx, tg)
        _, loss = module(*args, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        _, sl = serial(idx, tg)
        sl.backward()
        sopt.step()
        sopt.zero_grad()
        serial_losses.append(sl.item())
    pieces = {n: p.detach() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    merged = plan.merge_state_dicts(gathered)
    worst = max(((merged[n] - p.detach()).abs().max() / p.abs().max()).item()
                for n, p in serial.named_parameters())
    return {"losses": losses, "serial": serial_losses, "max_rel_param": worst}


def world_info():
    return dist.get_rank(), dist.get_world_size()
