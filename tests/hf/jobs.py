"""Jobs for real gloo runs of HuggingFace models (each worker runs the job as its rank)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

import autopar as ap
from tests.harness.hf_models import LLAMA_TP, LLAMA_VOCAB, inputs, llama
from tests.harness.serial import max_rel_diff


def llama_trains_like_serial(shape, axes, steps=2, lr=0.1):
    """LLaMA (GQA, rotary, RMSNorm) under the Megatron plan with ap.parallelize: SGD steps against
    serial training; returns the loss curves, the worst relative parameter difference after
    training (merged on every rank), and whether the collectives counted by ap.comm_stats
    in one step equal Plan.collectives()."""
    rank = dist.get_rank()
    serial, model = llama(), llama(seed=rank + 100)  # different init per rank: compile broadcasts
    with torch.no_grad():  # sharded parameters are cut from each rank's own model: make it serial's
        for p, q in zip(model.parameters(), serial.parameters()):
            p.copy_(q)
    kw = inputs("llama")
    ann = {**LLAMA_TP, **LLAMA_VOCAB}  # (presets.megatron finds the same: test_hf_presets; a trace saved)
    module = ap.parallelize(model, ap.Mesh(shape, axes), kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    plan = module.autopar_plan
    opt, sopt = torch.optim.SGD(module.parameters(), lr=lr), torch.optim.SGD(serial.parameters(), lr=lr)
    losses, serial_losses, counted = [], [], None
    for step in range(steps):
        kw = inputs("llama", seed=step + 10)
        args, local = plan.local_inputs(rank, **kw)
        with ap.comm_stats() as stats:
            loss = module(*args, **local)["loss"]
            loss.backward()  # the gradient sync finishes at the end of backward
        counted = counted or stats
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the same on every rank (rows split on dp: reduced on the way out)
        losses.append(total.item() / plan.mesh.size)
        sl = serial(**kw).loss
        sl.backward()
        sopt.step()
        sopt.zero_grad()
        serial_losses.append(sl.item())
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, {n: p.detach() for n, p in module.named_parameters()})
    merged = plan.merge_state_dicts(pieces)
    worst = max_rel_diff(merged, dict(serial.named_parameters()))
    ran = Counter((r.kind, round(r.bytes, 3)) for r in counted.records)
    planned = Counter((c.kind, round(c.bytes, 3)) for c in plan.collectives())
    return {
        "losses": losses,
        "serial": serial_losses,
        "max_rel_param": worst,
        "comm_equal": ran == planned,
        "ran": sorted(ran.items()),
        "planned": sorted(planned.items()),
    }
