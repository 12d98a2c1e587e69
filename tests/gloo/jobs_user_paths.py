"""gloo jobs for issue 32's user paths: ranks that planned differently, true failure messages."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.runtime.backend import current_backend
from tests.harness.models import MLP

TP = {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")}


def plans_differ(how: str):
    """Rank 1 plans another model config ("config") or other annotations ("annotations"),
    without debug=True: every rank must raise InconsistentPlanError (none aborts)."""
    torch.manual_seed(0)
    hidden = 64 if how == "config" and dist.get_rank() == 1 else 32
    ann = {"layers.*.fc1": ap.rowwise("tp")} if how == "annotations" and dist.get_rank() == 1 else TP
    model, x = MLP(d=8, hidden=hidden, layers=1), torch.randn(4, 8)
    try:
        ap.parallelize(model, ap.Mesh((dist.get_world_size(),), ("tp",)), args=(x,), annotations=ann, timeout=60.0)
    except ap.InconsistentPlanError as e:
        return str(e)
    return "no error"


def failure_after(timeout: float):
    """Rank 1 exits before the first forward's all-reduce: rank 0's message must say how long it
    really waited (and the timeout apart), not 'after waiting up to <timeout> s'."""
    import os

    torch.manual_seed(0)
    model, x = MLP(d=8, hidden=32, layers=1), torch.randn(4, 8)
    module = ap.parallelize(model, ap.Mesh((dist.get_world_size(),), ("tp",)), args=(x,), annotations=TP, timeout=60.0)
    current_backend().timeout = timeout
    if dist.get_rank() == 1:
        os._exit(3)
    module(x)  # raises CollectiveError (the pool reports it with rank 1's death)
    return "no error"


def state_dict_full_tensors(target: str, steps: int = 2):
    """Train ``target`` (tests/gloo/jobs_checkpoint.py's plans), then ap.get_state_dict: this
    rank's keys, and the worst relative difference of every value's full_tensor() from the serial
    model's parameters and AdamW state after the same steps."""
    from tests.gloo.jobs_checkpoint import EPS, LR, WD, _build, _train
    from tests.harness.models import gpt_batch, small_gpt

    plan, module, opt = _build(target, seed=0)
    _train(plan, module, opt, range(10, 10 + steps))
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    serial = small_gpt(seed=0)
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    for s in range(10, 10 + steps):
        serial(*gpt_batch(seed=s))[1].backward()
        serial_opt.step()
        serial_opt.zero_grad()
    ref = dict(serial.state_dict(keep_vars=False))
    named = dict(serial.named_parameters(remove_duplicate=False))
    worst, kinds = 0.0, set()
    for k, v in model_sd.items():
        kinds.add(type(v).__name__)
        worst = max(worst, _rel(v.full_tensor(), ref[k]))
    for fqn, entry in optim_sd["state"].items():
        for name, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                worst = max(worst, _rel(v.full_tensor(), serial_opt.state[named[fqn]][name]))
    keys = (list(model_sd), [(k, sorted(v)) for k, v in optim_sd["state"].items()])
    return {"keys": keys, "worst": worst, "kinds": sorted(kinds), "pieces_refuse_to_local": _refuses(model_sd)}


def _rel(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def _refuses(model_sd) -> bool | None:
    from autopar.checkpoint.pieces import Pieces

    v = next((v for v in model_sd.values() if isinstance(v, Pieces)), None)
    if v is None:
        return None
    try:
        v.to_local()
    except ap.PlanError:
        return all(repr(p) == "Boxes()" for p in v.placements)
    return False


def whole_tensor_optimizer_resumes(path: str, cls_name: str = "Adafactor"):
    """ap.Optimizer(Adafactor) on tp2: 2 steps, DCP save; a fresh dp2 plan with it loads and trains
    2 more: worst relative difference of this rank's pieces from serial after 4 steps."""
    import torch.distributed.checkpoint as dcp

    from tests.gloo.jobs_checkpoint import _build, _train, _worst
    from tests.harness.models import gpt_batch, small_gpt

    def made(target, seed):
        plan, module, _ = _build(target, seed=seed)
        return plan, module, ap.Optimizer(module, getattr(torch.optim, cls_name), lr=0.01)

    plan, module, opt = made("tp2", 0)
    _train(plan, module, opt, range(10, 12))
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    plan, module, opt = made("dp2", 7)
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ap.set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _train(plan, module, opt, range(12, 14))
    serial = small_gpt(seed=0)
    serial_opt = getattr(torch.optim, cls_name)(serial.parameters(), lr=0.01)
    for s in range(10, 14):
        serial(*gpt_batch(seed=s))[1].backward()
        serial_opt.step()
        serial_opt.zero_grad()
    return _worst(plan, module, serial)


def batch_norm_buffers_equal(broadcast: bool = True):
    """ConvBN on dp2 through ap.parallelize, 3 SGD steps: every rank's running statistics (all
    gathered), equal across ranks as DDP's broadcast_buffers makes them, or (False) each rank's own."""
    from tests.simulated.test_user_paths import ConvBN, _bn_batches

    torch.manual_seed(0)
    data = _bn_batches()
    dp = ap.DataParallel("dp", broadcast_buffers=broadcast)
    module = ap.parallelize(ConvBN(), ap.Mesh((dist.get_world_size(),), ("dp",)), args=(data[0],), data_parallel=dp)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for x in data:
        (local,), _ = module.autopar_plan.local_inputs(dist.get_rank(), x)
        module(local).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mean = module.get_buffer("bn.running_mean")
    everyone = [torch.empty_like(mean) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mean)
    return all(torch.equal(everyone[0], m) for m in everyone)


def titan_gqa_trains_as_serial(kv_heads: int, how: str = "annotations", steps: int = 2):
    """Issue 40: torchtitan's LLaMA with ``kv_heads`` kv heads on tp = world size, through
    ap.parallelize (its annotations, or the Megatron preset given the size), trained beside the
    serial model: (rank, serial) losses and the worst relative parameter difference after."""
    from tests.harness.distributed import merged_parameters, train_beside_serial
    from tests.harness.serial import max_rel_diff
    from tests.harness.titan_llama import TP as TITAN_TP
    from tests.harness.titan_llama import titan_batch, titan_llama

    tp = dist.get_world_size()
    model, serial, args = titan_llama(n_kv_heads=kv_heads), titan_llama(n_kv_heads=kv_heads), titan_batch()
    ann = TITAN_TP if how == "annotations" else ap.presets.megatron(model, "tp", args=args, size=tp)
    module = ap.parallelize(model, ap.Mesh((tp,), ("tp",)), args=args, annotations=ann)
    batches = [titan_batch(seed=s) for s in range(10, 10 + steps)]
    losses = train_beside_serial(module, serial, batches, lr=0.1, loss_of=lambda out: out)
    return {"losses": losses, "worst": max_rel_diff(merged_parameters(module), dict(serial.named_parameters()))}
