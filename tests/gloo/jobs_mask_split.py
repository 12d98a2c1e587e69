"""gloo jobs for gloo/test_mask_split.py (each worker runs the job as its rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.placement import shard_tensor
from tests.harness.hf_models import inputs, llama
from tests.harness.meshes import MESHES


def split_masks(plan) -> tuple[int, int]:
    """(how many 4-D bool tensors the plan builds, how many of them are split on some axis)."""
    masks = split = 0
    for node in plan.graph.nodes:
        val, lay = node.meta.get("val"), node.meta.get("autopar")
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool and val.ndim == 4 and lay and lay.spec:
            masks += 1
            split += any(not p.is_replicate() for p in lay.spec)
    return masks, split


def llama_sdpa_matches_serial(mesh_name):
    """HF LLaMA (sdpa, its causal mask built at the global batch) under ap.parallelize: this
    rank's loss and gradients against the serial model's, and how many masks the plan splits."""
    spec, rank = MESHES[mesh_name], dist.get_rank()
    kw = inputs("llama")
    ann = ap.presets.megatron(llama(layers=2, attn="sdpa"), "tp", kwargs=kw) if "tp" in spec.axes else {}
    module = ap.parallelize(
        llama(layers=2, attn="sdpa"), spec.mesh(), kwargs=kw, annotations=ann, data_parallel=spec.dp, dynamic=False
    )
    plan = module.autopar_plan
    args, kwargs = plan.local_inputs(rank, **kw)
    out = module(*args, **kwargs)
    loss = out["loss"] if isinstance(out, dict) else out[0]
    loss.backward()
    serial = llama(layers=2, attn="sdpa")
    sloss = serial(**kw).loss
    sloss.backward()
    named = dict(serial.named_parameters())
    worst = 0.0
    for n, p in module.named_parameters():
        ref = shard_tensor(named[n].grad, plan.param_specs[n], plan.mesh, rank)
        worst = max(worst, (p.grad - ref).abs().max().item())
    return loss.item(), sloss.item(), worst, split_masks(plan)
