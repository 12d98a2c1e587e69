"""Every random op follows the RNG contract (docs/randomness.md), not only dropout: a tensor
replicated on an axis draws the same numbers on every rank of it, a split one its own piece;
rng="serial" draws the serial model's numbers under any plan (plan.check seeds both alike), and
plan.check names randomness when it is the cause of a mismatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from tests.harness.meshes import MeshSpec

MESHES = [
    MeshSpec((2,), ("tp",)),
    MeshSpec((4,), ("tp",)),
    MeshSpec((2, 2), ("dp", "tp"), "dp"),
    MeshSpec((3,), ("dp",), "dp"),
    MeshSpec((2, 1, 2), ("dp", "pp", "tp"), "dp"),
]
IDS = ["tp2", "tp4", "dp2xtp2", "dp3", "dp2xpp1xtp2"]


def noise(h):
    """One of each random op a model meets (noise injection, a Gumbel/sampling router,
    SpecAugment-style masks), each feeding the output so its draws are compared."""
    a = h + 0.1 * torch.randn_like(h)
    b = a * torch.rand_like(a)
    c = b * torch.bernoulli(torch.sigmoid(b))
    d = c + torch.empty_like(c).exponential_().log()
    e = d + torch.empty_like(d).normal_(0, 0.1) + torch.empty_like(d).uniform_(-1, 1)
    f = e + torch.normal(e, 0.5) + torch.randn(e.shape[-1]) + e.clone().bernoulli_(0.5)
    g = F.dropout1d(f.unsqueeze(-1), 0.1, True).squeeze(-1) + F.alpha_dropout(f, 0.1, True)
    picked = torch.multinomial(torch.softmax(g, -1), 2, replacement=True)
    return g, picked


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h, hp = noise(self.fc(x))  # split on tp (column-parallel output)
        y, yp = noise(self.fc2(h))  # replicated on tp (row-parallel output)
        return y, hp, yp


def _plan(spec, rng, x):
    torch.manual_seed(0)
    ann = {"fc": ap.colwise("tp"), "fc2": ap.rowwise("tp")} if "tp" in spec.axes else {}
    return ap.plan(Noisy().train(), spec.mesh(), args=(x,), annotations=ann, data_parallel=spec.dp, rng=rng)


@pytest.mark.parametrize("spec", MESHES, ids=IDS)
def test_serial_rng_every_random_op_equals_serial(spec):
    x = torch.randn(6, 8)
    _plan(spec, "serial", x).check(x, loss=lambda out: out[0].square().mean(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", MESHES[:3], ids=IDS[:3])
def test_placement_rng_replicas_draw_alike(spec):
    """rng="placement": the tp ranks of one dp group hold the same replicated output (every
    random op drew alike there), and plan.check says randomness is why it is not serial's."""
    x = torch.randn(4, 8)
    plan = _plan(spec, "placement", x)
    outs = plan.simulate(lambda m, a: m(a), x)
    tp = spec.mesh().axis_index("tp")
    for r in spec.mesh().ranks():
        first = spec.mesh().group(tp, r)[0]
        assert torch.equal(outs[r][0], outs[first][0]) and torch.equal(outs[r][2], outs[first][2]), r
    with pytest.raises(ap.PlanMismatch, match=r"draws random numbers \(randn_like.*rng='placement'.*rng='serial'"):
        plan.check(x, loss=lambda out: out[0].square().mean())


class Attention(nn.Module):
    def __init__(self, p=0.2):
        super().__init__()
        self.qkv, self.proj, self.p = nn.Linear(16, 48), nn.Linear(16, 16), p

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("shape,axes", [((2,), ("tp",)), ((2, 2), ("dp", "tp"))])
def test_attention_dropout_follows_placements_and_mode(shape, axes):
    """scaled_dot_product_attention(dropout_p > 0): heads split on tp, its dropout drawn by
    placement (serial mode: the serial model's); in eval mode no dropout."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 16)
    ann = {"qkv": ap.colwise("tp", blocks=3), "proj": ap.rowwise("tp")}
    dp = "dp" if "dp" in axes else None
    plan = ap.plan(
        Attention().train(), ap.Mesh(shape, axes), args=(x,), annotations=ann, data_parallel=dp, rng="serial"
    )
    plan.check(x)
    plan.model.eval()
    evaluated = ap.plan(plan.model, ap.Mesh(shape, axes), args=(x,), annotations=ann, data_parallel=dp)
    evaluated.check(x)


def test_random_op_without_a_draw_is_refused():
    """rrelu in training draws per element and has no placement-following draw yet: refused
    with the op named, not left to draw differently on every rank."""

    class RRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return F.rrelu(self.fc(x), training=True)

    x = torch.randn(4, 8)
    plan = ap.plan(RRelu(), ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp")
    with pytest.raises(ap.ShardingError, match=r"rrelu.*draws random numbers.*replicas of one tensor would differ"):
        plan.module(0)


def test_compiled_rank_modules_draw_as_eager():
    """torch.compile sees the draw as an op that mutates the generator state: compiled rank
    modules draw the eager numbers, step after step."""
    x = torch.randn(4, 8)
    plan = _plan(MESHES[0], "serial", x)

    def run(module, a, wrap):
        ap.manual_seed(module, 5)
        f = wrap(module)
        return [f(a)[0] for _ in range(2)]

    eager = plan.simulate(lambda m, a: run(m, a, lambda f: f), x)
    compiled = plan.simulate(lambda m, a: run(m, a, torch.compile), x)
    for e, c in zip(eager, compiled):
        for a, b in zip(e, c):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(eager[0][0], eager[0][1])  # the second step drew new numbers


class Transposed(nn.Module):
    """Random draws on non-contiguous activations: ATen draws them into empty_like(x), in x's
    memory order (the fuzzer found dropout after a transpose drew another mask than serial)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).transpose(1, 2)
        return F.dropout(h, 0.3) + torch.rand_like(h) * torch.empty_like(h).normal_()


@pytest.mark.parametrize("shape,axes", [((2,), ("dp",)), ((2,), ("tp",))])
def test_serial_draws_on_transposed_tensors_equal_serial(shape, axes):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    ann = {"fc": ap.colwise("tp")} if "tp" in axes else {}
    dp = "dp" if "dp" in axes else None
    plan = ap.plan(
        Transposed().train(), ap.Mesh(shape, axes), args=(x,), annotations=ann, data_parallel=dp, rng="serial"
    )
    plan.check(x)


class InPlace(nn.Module):
    """nn.Dropout(inplace=True) and Dropout2d(inplace=True) (MobileNetV2's classifier)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop, self.drop2d = nn.Dropout(0.2, inplace=True), nn.Dropout1d(0.2, inplace=True)

    def forward(self, x):
        # in place on tensors no backward reads (a linear's output, a fresh copy), as a model must
        return self.drop(self.fc(x)) + self.drop2d(self.fc(x).transpose(1, 2).contiguous()).transpose(1, 2)


@pytest.mark.parametrize("rng", ["serial", "placement"])
def test_in_place_dropouts(rng):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    plan = ap.plan(InPlace().train(), ap.Mesh((2,), ("tp",)), args=(x,), annotations={"fc": ap.colwise("tp")}, rng=rng)
    if rng == "serial":
        plan.check(x)
    else:
        outs = plan.simulate(lambda m, a: m(a), x)
        assert torch.equal(outs[0], outs[1])  # the output is replicated on tp: one draw
