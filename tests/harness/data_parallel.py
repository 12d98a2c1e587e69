"""Shared by the data-parallel tests (simulated) and their gloo jobs: train a rank, train the
serial reference (global batch, or local SGD's own definition), and the option matrix.

    >>> plan = make_plan("dp2xtp2").with_data_parallel(ap.DataParallel("dp", **OPTIONS["zero2"]))
    >>> compare(plan.merge_state_dicts(per_rank), reference(plan, "adamw"), "zero2", "where")
"""

from __future__ import annotations

import torch

import autopar as ap
from tests.harness.meshes import MESHES
from tests.harness.models import MLP, MLP_TP
from tests.harness.serial import assert_params_close

OPTIONS = {
    "default": dict(),
    "buckets2": dict(bucket_max_params=2),
    "tinybytes": dict(bucket_mb=0.001),
    "zero1": dict(zero=1, bucket_max_params=3),
    "zero2": dict(zero=2, bucket_max_params=3),
    "bf16": dict(reduce_dtype=torch.bfloat16),
    "localsgd2": dict(local_sgd_every=2, bucket_max_params=3),
}

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}

STEPS = 3


def batches(n=STEPS, batch=8, d=16):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(batch, d, generator=g) for _ in range(n)]


def make_model(seed=0):
    torch.manual_seed(seed)
    return MLP()


def make_plan(mesh_name, model=None):
    """The MLP on a mesh of DP (Megatron's MLP split on tp where the mesh has it)."""
    spec = MESHES[mesh_name]
    model = model or make_model()
    ann = MLP_TP if "tp" in spec.axes else {}
    return ap.plan(model, spec.mesh(), args=(batches(1)[0],), annotations=ann, data_parallel="dp")


def loss_of(out):
    return out.sin().square().mean() + out.mean()  # not a constant of the final LayerNorm


def make_optimizer(module, opt_name, zero):
    cls, kw = OPTIMIZERS[opt_name]
    return ap.ZeroOptimizer(module, cls, **kw) if zero in (1, 2) else cls(module.parameters(), **kw)


def train_rank(plan, rank, opt_name, data=None, wrap=None, clear_with_module=False):
    """STEPS steps on ``rank``'s module (a fresh one, called through ``wrap(module)`` if given,
    e.g. torch.compile), gradients cleared by the optimizer's zero_grad() (``clear_with_module``:
    the module's, as loops written ``model.zero_grad()`` do); returns its parameters by serial name."""
    module = plan.build_module(rank)
    run = wrap(module) if wrap is not None else module
    dp = plan.data_parallel
    opt = make_optimizer(module, opt_name, dp.zero)
    if dp.local_sgd_every is not None:
        module.autopar_local_sgd.attach(opt)
    for x in data or batches():
        (a,), _ = plan.local_inputs(rank, x)
        loss_of(run(a)).backward()
        opt.step()
        (module if clear_with_module else opt).zero_grad()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def train_serial(opt_name, data=None):
    model = make_model()
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    for x in data or batches():
        loss_of(model(x)).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def train_local_sgd(opt_name, dp, every, data=None):
    """Local SGD by its definition: dp replicas, each on its slice, averaged every ``every`` steps."""
    cls, kw = OPTIMIZERS[opt_name]
    models = [make_model() for _ in range(dp)]
    opts = [cls(m.parameters(), **kw) for m in models]
    for step, x in enumerate(data or batches(), 1):
        for m, o, xs in zip(models, opts, x.chunk(dp)):
            loss_of(m(xs)).backward()
            o.step()
            o.zero_grad()
        if step % every == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return dict(models[0].named_parameters())


def reference(plan, opt_name):
    dp = plan.data_parallel
    if dp.local_sgd_every is not None:
        return train_local_sgd(opt_name, plan.mesh.shape[plan.dp_axis], dp.local_sgd_every)
    return train_serial(opt_name)


def tolerance(option):
    # bf16 reduction: 8 bits of mantissa on the gradients (the result differs from fp32, see tests)
    return dict(rtol=2e-2, atol=2e-3) if option == "bf16" else dict(rtol=1e-5, atol=1e-6)


def compare(merged: dict, ref: dict, option: str, where: str) -> None:
    assert_params_close(merged, ref, where, **tolerance(option))
