"""gloo jobs for uneven pieces (issue 24): a GPT with an odd vocabulary and an odd sequence
trained with ap.parallelize on real processes, against the serial model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autopar as ap
from tests.harness.distributed import merged_parameters, train_beside_serial
from tests.harness.models import GPT_SEQUENCE_PARALLEL, GPT_VOCAB, MEGATRON
from tests.harness.serial import max_rel_diff
from tests.harness.uneven import uneven_batch, uneven_gpt

ANNOTATIONS = {"megatron_vocab": MEGATRON | GPT_VOCAB, "sequence_parallel": GPT_SEQUENCE_PARALLEL, "none": {}}


def uneven_gpt_trains_like_serial(shape, axes, annotations: str, steps: int = 2, lr: float = 0.2, dynamic=False):
    """SGD steps of the vocab-67 GPT (batch 6, sequence 7; some targets ignored) on every rank; the
    worst relative parameter difference from the serial model after them, and both loss curves.
    ``dynamic``: the batch sized at run time (cut 2,2,1,1 on dp=4: a ragged plan)."""
    model, serial = uneven_gpt(67), uneven_gpt(67)
    dp = "dp" if "dp" in axes else None
    module = ap.parallelize(
        model,
        ap.Mesh(tuple(shape), tuple(axes)),
        args=uneven_batch(67),
        annotations=ANNOTATIONS[annotations],
        data_parallel=dp,
        dynamic=dynamic,
    )
    pairs = train_beside_serial(module, serial, [_batch(seed=step + 10) for step in range(steps)], lr)
    worst = max_rel_diff(merged_parameters(module), dict(serial.named_parameters()))
    return {"losses": [p[0] for p in pairs], "serial": [p[1] for p in pairs], "max_rel_param": worst}


def _batch(seed):
    idx, tg = uneven_batch(67, seed=seed)
    tg[-1, 2:] = -100  # the last rank's tokens mostly ignored: token-weighted mean
    return idx, tg


def _parallel_gpt(shape, axes, zero: int = 0, seed: int = 0):
    model = uneven_gpt(67, seed=seed)
    dp = ap.DataParallel("dp", zero=zero) if "dp" in axes else None
    ann = MEGATRON | GPT_VOCAB if "tp" in axes else {}
    mesh = ap.Mesh(tuple(shape), tuple(axes))
    return ap.parallelize(model, mesh, args=uneven_batch(67), annotations=ann, data_parallel=dp)


def checkpoint_round_trips(path: str, shape, axes, zero: int, load_shape, load_axes):
    """The vocab-67 GPT saved by DCP from one layout (uneven pieces) and loaded into another (also
    uneven, or even), and saved / loaded as HF safetensors: the worst relative difference of
    every value's full_tensor() and of the loaded parameters from the serial model's."""
    import torch.distributed.checkpoint as dcp

    serial = dict(uneven_gpt(67).named_parameters())
    module = _parallel_gpt(shape, axes, zero)
    model_sd, _ = ap.get_state_dict(module)
    worst_full = max((model_sd[n].full_tensor() - p).abs().max().item() for n, p in serial.items())
    dcp.save({"model": model_sd}, checkpoint_id=path + "/dcp")
    ap.save_pretrained(module, path + "/hf")
    dist.barrier()
    results = {"full_tensor": worst_full}
    for how in ("dcp", "hf"):
        other = _parallel_gpt(load_shape, load_axes, seed=5)  # other values: the load must replace them
        if how == "dcp":
            sd, _ = ap.get_state_dict(other)
            dcp.load({"model": sd}, checkpoint_id=path + "/dcp")
            ap.set_state_dict(other, model_state_dict=sd)
        else:
            ap.load_pretrained(other, path + "/hf")
        merged = merged_parameters(other)
        results[how] = max((merged[n] - p).abs().max().item() for n, p in serial.items())
    return results


def ragged_gather_matches_serial(rows: int = 5):
    """A batch of ``rows`` placed split on a 4-way non-data-parallel axis (pieces only their
    ranks know the sizes of), outputs gathered: the forward output and every gradient after one
    backward against the serial model's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(rows + 2, 16)
    module = ap.parallelize(
        model, ap.Mesh((dist.get_world_size(),), ("a",)), args=(x,), annotations={"input": ap.place(ap.Shard(0))}
    )
    serial = copy.deepcopy(model)
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(1))  # another size at run time
    (local,), _ = module.autopar_plan.local_inputs(dist.get_rank(), x)
    out = module(local)
    out.square().sum().backward()
    ref = serial(x)
    ref.square().sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    merged = module.autopar_plan.merge_state_dicts(gathered)
    return {
        "rows": tuple(local.shape),
        "out": ((out - ref).abs().max() / ref.abs().max()).item(),
        "grads": max_rel_diff(merged, {n: p.grad for n, p in serial.named_parameters()}),
        "ragged": "ragged_all_gather" in module.code,
    }
