"""Comparing a rank module with the serial model inside a gloo job (each worker runs it as its rank).

>>> losses = train_beside_serial(module, serial, batches, lr=0.2)
>>> worst = max_rel_diff(merged_parameters(module), dict(serial.named_parameters()))
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

import autopar as ap


def merged_parameters(module) -> dict:
    """Every rank's parameter pieces gathered and merged into the serial names and shapes (a collective:
    every rank calls it)."""
    pieces = {n: p.detach().clone() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    return module.autopar_plan.merge_state_dicts(gathered)


def train_beside_serial(
    module,
    serial,
    batches: Iterable[tuple],
    lr: float,
    loss_of: Callable = lambda out: out[1],
    seeded: bool = False,
) -> list[tuple[float, float]]:
    """SGD steps of the rank module on this rank's pieces of each global batch and of the serial model
    on the whole batch; the (rank, serial) loss of each step. ``seeded``: both draw their random ops from
    the step's seed (``rng="serial"`` plans: the same masks as serial)."""
    plan, rank = module.autopar_plan, dist.get_rank()
    opt, sopt = torch.optim.SGD(module.parameters(), lr=lr), torch.optim.SGD(serial.parameters(), lr=lr)
    losses = []
    for step, batch in enumerate(batches):
        if seeded:
            ap.manual_seed(module, step)
        args, kwargs = plan.local_inputs(rank, *batch)
        loss = loss_of(module(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if seeded:
            torch.manual_seed(step)
        serial_loss = loss_of(serial(*batch))
        serial_loss.backward()
        sopt.step()
        sopt.zero_grad()
        losses.append((loss.item(), serial_loss.item()))
    return losses
