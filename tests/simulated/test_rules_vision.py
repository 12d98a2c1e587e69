"""Vision and sequence-op rules against serial (forward and every gradient) on (2,), (4,), (2, 2):
conv (plain, grouped, depthwise, 1-D/3-D, channel splits), pooling, batch/group/instance norm,
upsampling, pixel shuffle, unfold/fold, topk/sort/argsort, gather/scatter/index ops, flatten,
unflatten, numpy_T, copy_; a ResNet-style CNN and a small ViT under data parallel with no
gather of the batch; synchronised batch norm equal to serial in training mode."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from tests.harness.meshes import RULE_MESHES
from tests.simulated.test_rules import OpModule, three

S, R = ap.Shard, ap.Replicate()
B0 = three((S(0),), (S(0),), (S(0), S(1)))  # batch split (and channels on (2, 2))
ROWS = three((S(0),), (S(0),), (S(0), R))  # rows split, (2, 2): the second axis replicated
C1 = three((S(1),), (S(1),), (S(0), S(1)))  # channels split (and batch on (2, 2))


def run_case(fn, shape, placements_per_mesh, extra=()):
    """tests.simulated.test_rules.run_case with a tolerance for convolutions (their kernels sum in an
    order that depends on the batch size)."""
    torch.manual_seed(0)
    model = OpModule(fn, shape, extra)
    x = torch.randn(shape)
    for spec, placements in zip(RULE_MESHES, placements_per_mesh):
        mshape, axes = spec.shape, spec.axes
        plan = ap.plan(model, ap.Mesh(mshape, axes), args=(x,), annotations={"x": ap.place(*placements)}, strict=True)
        try:
            plan.check(x, rtol=1e-4, atol=1e-5)
        except ap.PlanMismatch as e:
            raise ap.PlanMismatch(f"on {mshape} with x {placements}: {e}\n{plan}") from None


def conv(w_shape, groups=1, bias=False, **kw):
    def fn(x, w, *b):
        conv_fn = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()]
        return conv_fn(x, w, b[0] if b else None, groups=groups, **kw)

    return fn, [w_shape] + ([(w_shape[0],)] if bias else [])


def _case(fn_extra, shape, placements):
    fn, extra = fn_extra
    return fn, shape, placements, extra


CASES = {
    "conv2d_batch": _case(conv((8, 4, 3, 3), bias=True, padding=1), (4, 4, 6, 6), B0),
    "conv2d_in_channels": _case(conv((8, 4, 3, 3), padding=1), (4, 4, 6, 6), C1),
    "conv2d_depthwise": _case(conv((8, 1, 3, 3), groups=8, bias=True, padding=1), (4, 8, 6, 6), C1),
    "conv2d_grouped": _case(conv((8, 2, 3, 3), groups=4, stride=2), (4, 8, 6, 6), C1),
    "conv1d": _case(conv((6, 4, 3), bias=True, padding=1), (4, 4, 8), B0),
    "conv3d": _case(conv((4, 4, 3, 3, 3), bias=True, padding=1), (4, 4, 4, 4, 4), B0),
    "max_pool": (lambda x: F.max_pool2d(x, 2) + F.adaptive_max_pool2d(x, 3)[..., :3, :3], (4, 4, 6, 6), C1),
    "avg_pool": (lambda x: F.avg_pool2d(x, 2, ceil_mode=True) + F.adaptive_avg_pool2d(x, 3), (4, 4, 6, 6), B0),
    "pool1d": (lambda x: F.max_pool1d(x, 2) + F.avg_pool1d(x, 2), (4, 4, 8), C1),
    "group_norm": (lambda x, w, b: F.group_norm(x, 4, w, b), (4, 8, 4, 4), C1, [(8,), (8,)]),
    "instance_norm": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (4, 8, 4, 4), C1, [(8,), (8,)]),
    "batch_norm_channels": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        (4, 8, 4, 4),
        three((S(1),), (S(1),), (R, S(1))),
        [(8,), (8,)],
    ),
    "batch_norm_eval": (
        lambda x, w, b: F.batch_norm(x, torch.zeros(8), torch.ones(8) * 2, w, b, training=False),
        (4, 8, 4, 4),
        B0,
        [(8,), (8,)],
    ),
    "upsample": (
        lambda x: F.interpolate(x, scale_factor=2) + F.interpolate(x, size=(8, 8), mode="bilinear"),
        (4, 4, 4, 4),
        C1,
    ),
    "pixel_shuffle": (
        lambda x: (
            F.pixel_shuffle(x, 2).sum(1, keepdim=True) * F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2)[:, :1].mean()
        ),
        (4, 8, 4, 4),
        B0,
    ),
    "pixel_shuffle_channels": (lambda x: F.pixel_shuffle(x, 2), (4, 16, 4, 4), C1),
    "unfold_fold": (lambda x: F.fold(F.unfold(x, 2, stride=2) * 2, (4, 4), 2, stride=2), (4, 4, 4, 4), C1),
    "topk": (lambda x: torch.topk(x, 2, dim=-1).values * x[..., :2], (8, 4), ROWS),
    "sort_argsort": (
        lambda x: torch.sort(x, dim=0).values + x.gather(0, torch.argsort(x, dim=0, stable=True)),
        (8, 4),
        three((S(1),), (S(1),), (S(1), R)),
    ),
    "cumprod": (lambda x: torch.cumprod(x, 1), (8, 4), ROWS),
    "gather_scatter": (
        lambda x: (
            x.gather(1, x.argmax(1, keepdim=True))
            + torch.zeros_like(x).scatter_add(1, x.argmin(1, keepdim=True), x[:, :1])
        ),
        (8, 4),
        ROWS,
    ),
    "index_select_add": (
        lambda x: (
            x.index_select(1, torch.tensor([3, 0])).sum(1, keepdim=True)
            + torch.zeros(8, 4).index_add(1, torch.tensor([1, 1, 2, 0]), x)
        ),
        (8, 4),
        ROWS,
    ),
    "flatten_unflatten": (
        lambda x: x.flatten(1).unflatten(1, (2, 8)).sum(-1),
        (4, 4, 4),
        three((S(0),), (S(1),), (S(0), S(1))),
    ),
    "numpy_T": (lambda x, w: x @ w.T, (8, 4), ROWS, [(6, 4)]),
    "copy_": (lambda x: torch.zeros(8, 4).copy_(x) * 2, (8, 4), three((S(1),), (S(0),), (S(0), S(1)))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_matches_serial(name):
    fn, shape, placements, *extra = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run_case(fn, shape, placements, extra[0] if extra else ())


class ResNetish(nn.Module):
    """conv-bn-relu, a residual block with a depthwise conv, pooling and a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, groups=8),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 1),
            nn.GroupNorm(2, 8),
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = F.max_pool2d(self.stem(x), 2)
        x = F.relu(x + self.block(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TinyViT(nn.Module):
    """Patch embedding (conv, stride = patch), class token, one pre-norm encoder block."""

    def __init__(self, d=16):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1)
        h = self.norm(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.mlp(t)
        return self.head(t[:, 0])


def _no_dp_gather(plan):
    """All-gathers on dp besides the outputs'. (ViT's class token, a broadcast parameter, still
    gets its gradient all-gathered in the backward: 1 x d per sample, not the batch.)"""
    return [
        c
        for c in plan.collectives()
        if c.kind == "all_gather"
        and c.axis == "dp"
        and c.node != "output"
        and not (c.phase == "backward" and c.src == "expand")
    ]


@pytest.mark.parametrize("shape,axes", [((2,), ("dp",)), ((4,), ("dp",)), ((2, 2), ("dp", "x"))])
@pytest.mark.parametrize("build", [ResNetish, TinyViT])
def test_data_parallel_keeps_the_batch_split(build, shape, axes):
    """Eval mode (batch norm on running statistics): equal to serial with no gather of the batch."""
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(8, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no op falls back to gathered-and-replicated
        plan = ap.plan(model, ap.Mesh(shape, axes), args=(x,), data_parallel="dp")
    plan.check(x, rtol=1e-4, atol=1e-5)
    assert not _no_dp_gather(plan), plan


def test_sync_batch_norm_equals_serial_in_training():
    """Training mode: local statistics (DDP) differ from serial; ap.sync_batch_norm makes the
    plan equal to serial, outputs, gradients and the running statistics."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    model = ResNetish().train()
    mesh = ap.Mesh((2, 2), ("dp", "x"))
    plan = ap.plan(model, mesh, args=(x,), data_parallel="dp")
    with pytest.raises(ap.PlanMismatch):
        plan.check(x, rtol=1e-4, atol=1e-5)
    ap.sync_batch_norm(model)
    for shape, axes in [((2,), ("dp",)), ((4,), ("dp",)), ((2, 2), ("dp", "x"))]:
        plan = ap.plan(model, ap.Mesh(shape, axes), args=(x,), data_parallel="dp")
        plan.check(x, rtol=1e-4, atol=1e-5)
        assert not _no_dp_gather(plan)
    serial = ResNetish().train()
    serial.load_state_dict(model.state_dict())
    serial(x)
    plan.simulate(lambda m, *a: m(*a), x)
    bn = dict(plan.module(0).named_buffers())
    name = next(n for n in bn if "running_var" in n)
    assert torch.allclose(bn[name], dict(serial.named_buffers())["stem.1.running_var"], atol=1e-5)
