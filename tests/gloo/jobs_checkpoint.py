"""gloo jobs for the checkpoint tests: train, save through DCP, load into other plans."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar as ap
from autopar.placement import shard_tensor
from tests.harness.models import MEGATRON, gpt_batch, small_gpt

LR, WD, EPS = 0.01, 0.1, 1e-3  # eps well above float noise: AdamW divides by sqrt(v)
QKV_BLOCKS = dict(MEGATRON, **{"blocks.*.attn.qkv": ap.colwise("tp", blocks=3)})
TARGETS = {  # name -> (mesh shape, axes, data parallel, annotations, pipeline)
    "tp2": ((2,), ("tp",), None, MEGATRON, None),
    "dp2": ((2,), ("dp",), "dp", {}, None),
    "dp2_zero2": ((2,), ("dp",), ap.DataParallel("dp", zero=2, bucket_max_params=3), {}, None),
    "dp2xtp2": ((2, 2), ("dp", "tp"), "dp", MEGATRON, None),
    "dp2_zero3": ((2,), ("dp",), ap.DataParallel("dp", zero=3), {}, None),
    "dp2_zero3_bf16": ((2,), ("dp",), ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16), {}, None),
    "dp2xtp2_zero3": ((2, 2), ("dp", "tp"), ap.DataParallel("dp", zero=3), MEGATRON, None),
    "hsdp_rep2xshard2": ((2, 2), ("rep", "shard"), ap.DataParallel("shard", zero=3, replicate_axis="rep"), {}, None),
    "tp4_blocks": ((4,), ("tp",), None, QKV_BLOCKS, None),
    "pp2xtp2": ((2, 2), ("pp", "tp"), None, MEGATRON, ap.Pipeline("pp", microbatches=2)),
    "pp2xdp2_zero3": ((2, 2), ("pp", "dp"), ap.DataParallel("dp", zero=3), {}, ap.Pipeline("pp", microbatches=2)),
    # zero-bubble schedules: a V puts the tied embedding and head both on pp rank 0; B/W split
    "pp2_dualpipev": ((2,), ("pp",), None, {}, ap.Pipeline("pp", microbatches=4, schedule="dualpipev", chunks=2)),
    "pp2xdp2_zbv_zero3": (
        (2, 2),
        ("pp", "dp"),
        ap.DataParallel("dp", zero=3),
        {},
        ap.Pipeline("pp", microbatches=2, schedule="zbv", chunks=2),
    ),
    "pp2xtp2_zb_h1": ((2, 2), ("pp", "tp"), None, MEGATRON, ap.Pipeline("pp", microbatches=2, schedule="zb-h1")),
    # cp folded into the FSDP group: a piece's range is its place in the dp x cp group's chunks
    "dp2xcp2_zero3_fold": ((2, 2), ("dp", "cp"), ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp")), {}, None),
}
CONTEXT = {"dp2xcp2_zero3_fold": ap.ContextParallel("cp", method="ring", load_balance=True)}


def _build(target, seed):
    shape, axes, dp, ann, pipe = TARGETS[target]
    model = small_gpt(seed=seed)
    kw = dict(args=gpt_batch(), annotations=ann, data_parallel=dp, context_parallel=CONTEXT.get(target))
    if pipe is not None:
        plan = ap.plan(model, ap.Mesh(shape, axes), pipeline=pipe, **kw)
        runner = plan.pipeline_runner(dist.get_rank())
        return plan, runner, torch.optim.AdamW(runner.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    module = ap.parallelize(model, ap.Mesh(shape, axes), **kw)
    if getattr(dp, "zero", 0) in (1, 2):
        return module.autopar_plan, module, ap.ZeroOptimizer(module, torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    return module.autopar_plan, module, torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD, eps=EPS)


def _train(plan, module, opt, steps):
    for s in steps:
        batch = gpt_batch(seed=s)
        if hasattr(module, "step"):  # a PipelineRunner
            module.step(batch)
        else:
            args, kwargs = plan.local_inputs(dist.get_rank(), *batch)
            module(*args, **kwargs)[1].backward()
        opt.step()
        opt.zero_grad()


def train_and_save(target, path, steps=3, use_async=False):
    plan, module, opt = _build(target, seed=0)
    _train(plan, module, opt, range(10, 10 + steps))
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    if use_async:  # staged to CPU copies, written in the background
        dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path).result()
    else:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return sorted(model_sd)


def load_and_train(target, path, steps=3, first=3):
    """Load into ``target`` (another init), train ``steps`` more; worst relative difference of
    this rank's parameter pieces from serial AdamW over first + steps steps."""
    plan, module, opt = _build(target, seed=7)
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ap.set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _train(plan, module, opt, range(10 + first, 10 + first + steps))
    return _worst(plan, module, _serial(first + steps))


def _serial(steps):
    model = small_gpt(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    for s in range(10, 10 + steps):
        model(*gpt_batch(seed=s))[1].backward()
        opt.step()
        opt.zero_grad()
    return model


def _worst(plan, module, serial):
    named = dict(serial.named_parameters(remove_duplicate=False))
    local = module.params if hasattr(module, "step") else dict(module.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in local.items():
        if isinstance(p, torch.nn.Parameter):
            ref = shard_tensor(named[name].detach(), plan.param_specs[name], plan.mesh, dist.get_rank())
            for technique in plan.options.techniques:  # zero=3 stores a 1-D piece of a flat bucket
                ref = technique.stored(plan, dist.get_rank(), name, ref)
            if p.numel() == 0:
                continue
            worst = max(worst, ((p.detach() - ref).abs().max() / ref.abs().max()).item())
    return worst


def policy_masters_round_trip(path, into="tp2"):
    """Train under the bf16 policy (zero=3), save through DCP, load into ``into`` (fp32, another
    init): (the saved values' dtypes, the largest difference of a loaded full tensor from the saved)."""
    plan, module, opt = _build("dp2_zero3_bf16", seed=0)
    _train(plan, module, opt, range(10, 13))
    saved, optim_sd = ap.get_state_dict(module, opt)
    dcp.save({"model": saved, "optim": optim_sd}, checkpoint_id=path)
    full = {k: v.full_tensor() for k, v in saved.items()}
    _, other, other_opt = _build(into, seed=7)
    model_sd, other_optim_sd = ap.get_state_dict(other, other_opt)
    dcp.load({"model": model_sd, "optim": other_optim_sd}, checkpoint_id=path)
    ap.set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=other_optim_sd)
    loaded = {k: v.full_tensor() for k, v in ap.get_state_dict(other)[0].items()}
    worst = max((loaded[k] - full[k]).abs().max().item() for k in full)
    return sorted({str(v.dtype) for v in saved.values()}), worst


def policy_resume(path):
    """Resume under the bf16 policy: 3 steps under DataParallel(zero=3, param_dtype=bf16), saved
    through DCP; 2 more steps go on in the same processes, and again in a plan of another init that
    loads the checkpoint (fp32 masters and fp32 AdamW state). (dtypes of the optimizer state saved,
    the largest difference of a resumed piece from the uninterrupted run's, of the losses)."""
    plan, module, opt = _build("dp2_zero3_bf16", seed=0)
    _train(plan, module, opt, range(10, 13))
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    states = sorted({str(v.dtype) for v in _tensors(optim_sd)})
    want = _losses(plan, module, opt, range(13, 15))
    plan2, other, other_opt = _build("dp2_zero3_bf16", seed=7)
    model_sd, optim_sd = ap.get_state_dict(other, other_opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ap.set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    got = _losses(plan2, other, other_opt, range(13, 15))
    pieces = dict(module.named_parameters())
    worst = max((p.detach() - pieces[n].detach()).abs().max().item() for n, p in other.named_parameters() if p.numel())
    return states, worst, max(abs(a - b) for a, b in zip(got, want))


def _losses(plan, module, opt, steps):
    out = []
    for s in steps:
        args, kwargs = plan.local_inputs(dist.get_rank(), *gpt_batch(seed=s))
        loss = module(*args, **kwargs)[1]
        loss.backward()
        out.append(loss.item())
        opt.step()
        opt.zero_grad()
    return out


def _tensors(tree):
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) and tree.is_floating_point() else []


def plain_state_dict_refused(path):
    """DCP on a split rank module's plain state_dict(): save and load must raise."""
    plan, module, _ = _build("tp2", seed=0)
    dcp.save(ap.get_state_dict(module)[0], checkpoint_id=path + "/right")
    out = []
    for call in (
        lambda: dcp.save(module.state_dict(), checkpoint_id=path + "/plain"),
        lambda: dcp.load(module.state_dict(), checkpoint_id=path + "/right"),
    ):
        try:
            call()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - DCP wraps rank errors in a BaseException
            out.append(str(e))
    return out


# ------------------------------------------------------------------------ HuggingFace
def _meta_llama(path, shape, axes, dp):
    from transformers import AutoConfig, LlamaForCausalLM
    from tests.harness.hf_models import inputs

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(path)).eval()
    kw = inputs("llama")
    ann = ap.presets.megatron(model, "tp", kwargs=kw)
    module = ap.parallelize(model, ap.Mesh(shape, axes), kwargs=kw, annotations=ann, data_parallel=dp, dynamic=False)
    return module, kw


def hf_load_matches_serial(path, shape=(2,), axes=("tp",), dp=None):
    """Meta LLaMA planned with the Megatron preset, load_pretrained: loss and grads vs serial
    (gradients compared on the pieces the rank stores: zero=3 keeps a range of each)."""
    from transformers import LlamaForCausalLM

    module, kw = _meta_llama(path, shape, axes, dp)
    ap.load_pretrained(module, path)
    plan, rank = module.autopar_plan, dist.get_rank()
    args, kwargs = plan.local_inputs(rank, **kw)
    out = module(*args, **kwargs)
    loss = out["loss"] if isinstance(out, dict) else out[0]
    loss.backward()
    serial = LlamaForCausalLM.from_pretrained(path).eval()
    sloss = serial(**kw).loss
    sloss.backward()
    named = dict(serial.named_parameters())
    worst = 0.0
    for n, p in module.named_parameters():
        ref = shard_tensor(named[n].grad, plan.param_specs[n], plan.mesh, rank)
        for technique in plan.options.techniques:
            ref = technique.stored(plan, rank, n, ref)
        if ref.numel():
            worst = max(worst, (p.grad - ref).abs().max().item())
    return loss.item(), sloss.item(), worst


def hf_save_from_plan(path, out_path, zero=0):
    """Meta LLaMA on (2, 2) dp x tp, load_pretrained, save_pretrained: rank 0 compares from_pretrained."""
    from transformers import LlamaForCausalLM

    module, _ = _meta_llama(path, (2, 2), ("dp", "tp"), ap.DataParallel("dp", zero=zero))
    ap.load_pretrained(module, path)
    ap.save_pretrained(module, out_path)
    if dist.get_rank() != 0:
        return None
    want = LlamaForCausalLM.from_pretrained(path).state_dict()
    got = LlamaForCausalLM.from_pretrained(out_path).state_dict()
    return sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)


def serial_gpt():
    """Factory for ``autopar convert --model tests.gloo.jobs_checkpoint:serial_gpt``."""
    return small_gpt(seed=5)


def serial_after(steps):
    return _serial(steps)


def policy_hf_save(out_path, steps=2):
    """A tiny LLaMA on (2, 2) dp x tp (Megatron, zero=3) under the bf16 policy, ``steps`` AdamW
    steps, ap.save_pretrained; ap.load_pretrained into the same plan of another init. Every rank
    returns whether its loaded pieces equal its trained masters bit for bit and the two modules'
    losses; rank 0 adds the saved files' dtypes, the largest difference of transformers'
    from_pretrained from the merged masters, and the losses of the serial recipe's model
    (tests/harness/precision.py, the same AdamW steps) before and after the steps."""
    import copy

    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from tests.harness.hf_models import causal_lm, inputs
    from tests.harness.precision import loss_of, recipe_reference

    rank, bf16 = dist.get_rank(), torch.bfloat16
    model, kw = causal_lm("llama", layers=1), inputs("llama")
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    ann = dict(ap.presets.megatron(model, "tp", kwargs=kw))
    dp = ap.DataParallel("dp", zero=3, param_dtype=bf16)

    def build(seed):
        fresh = causal_lm("llama", layers=1, seed=seed)
        return ap.parallelize(fresh, ap.Mesh((2, 2), ("dp", "tp")), kwargs=kw, annotations=ann, data_parallel=dp)

    module = build(0)
    plan = module.autopar_plan
    _, local = plan.local_inputs(rank, **kw)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        module(**local).loss.float().backward()
        opt.step()
        opt.zero_grad()
    ap.save_pretrained(module, out_path)
    other = build(7)
    ap.load_pretrained(other, out_path)
    mine = dict(module.named_parameters())
    same = all(torch.equal(p, mine[n]) for n, p in other.named_parameters())
    with torch.no_grad():
        losses = [m(**local).loss.float().item() for m in (module, other)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {n: p.detach() for n, p in mine.items()})
    if rank != 0:
        return same, losses, None
    masters = plan.merge_state_dicts(gathered)
    files = [f for f in __import__("os").listdir(out_path) if f.endswith(".safetensors")]
    dtypes = sorted({str(t.dtype) for f in files for t in load_file(f"{out_path}/{f}").values()})
    hf = LlamaForCausalLM.from_pretrained(out_path).state_dict()
    worst = max((hf[n] - masters[n]).abs().max().item() for n in masters)
    serial = copy.deepcopy(model)
    recipe_reference(serial, kw, bf16, steps=steps, lr=1e-2)
    with torch.no_grad():
        after = loss_of(
            torch.func.functional_call(serial, {n: p.to(bf16) for n, p in serial.named_parameters()}, (), kw)
        )
        before = loss_of(torch.func.functional_call(model, {n: p.to(bf16) for n, p in init.items()}, (), kw))
    return same, losses, (dtypes, worst, before.item(), after.item())
