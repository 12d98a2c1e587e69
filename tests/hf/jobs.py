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


def ulysses_trains_like_serial(name, shape, axes, case, steps=3):
    """A tiny HF LLaMA or Qwen2 (SDPA, GQA) under Ulysses context parallel on ``axes``' "cp" axis,
    load balanced, ``case``: "packed" (documents packed along the sequence on cp alone), "tp" (the
    Megatron preset on a tp axis) or "zero3" (ZeRO-3 folded over dp x cp): AdamW steps on real
    processes against the serial model's; the worst relative parameter difference (merged on every
    rank) and whether one step's collectives (ap.comm_stats) are the plan's."""
    from tests.harness.hf_models import ADAMW, causal_lm, packed_batch

    rank = dist.get_rank()

    def build():
        return llama(layers=2, attn="sdpa") if name == "llama" else causal_lm(name, layers=2, attn="sdpa")

    def batch(seed):
        if case == "packed":
            return packed_batch(docs=((5, 7, 4), (16,)), seed=seed)
        return inputs("llama", b=4, s=16, seed=seed)

    serial, kw = build().train(), batch(1)
    mesh = ap.Mesh(shape, axes)
    ann = ap.presets.megatron(serial, "tp", kwargs=kw) if case == "tp" else None
    dp = ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp")) if case == "zero3" else None
    cp = ap.ContextParallel("cp", method="ulysses", load_balance=True)
    module = ap.parallelize(build(), mesh, kwargs=kw, annotations=ann, data_parallel=dp, context_parallel=cp)
    plan = module.autopar_plan
    opt, sopt = torch.optim.AdamW(module.parameters(), **ADAMW), torch.optim.AdamW(serial.parameters(), **ADAMW)
    counted = None
    for step in range(steps):
        kw = batch(step + 1)
        args, local = plan.local_inputs(rank, **kw)
        with ap.comm_stats() as stats:
            module(*args, **local).loss.backward()
        counted = counted or stats
        opt.step()
        opt.zero_grad()
        serial(**kw).loss.backward()
        sopt.step()
        sopt.zero_grad()
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, {n: p.detach() for n, p in module.named_parameters()})
    worst = max_rel_diff(plan.merge_state_dicts(pieces), dict(serial.named_parameters()))
    ran = Counter((r.kind, round(r.bytes, 3)) for r in counted.records if r.kind != "broadcast")
    planned = Counter((c.kind, round(c.bytes, 3)) for c in plan.collectives())
    return {"max_rel_param": worst, "comm_equal": ran == planned, "ran": sorted(ran.items()),
            "planned": sorted(planned.items())}  # fmt: skip
