"""The rules added for PyTorch's OpInfo database (issue 31), each on its own: x (and where the op
takes more tensors, those parameters) forced into a split layout, serial vs every rank (outputs and
every gradient) on meshes (2,), (4,) and (2, 2), ``strict=True`` (a missing rule is an error here),
and the op under test must run split (a gathered run would not test its rule).
The whole database: fuzz/opinfo.py (``make opinfo``); a subset in test_opinfo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.placement import Replicate, Shard
from tests.harness.meshes import RULE_MESHES

R, S = Replicate(), Shard


class Ops(nn.Module):
    """fn(x * w, *params): the weight (one number: it splits nowhere) makes gradients flow back
    through the op under test."""

    def __init__(self, fn, shape, params):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.tensor([2.0]))
        self.params = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in params)

    def forward(self, x):
        return self.fn(x * self.w, *self.params)


# name: (fn, x shape, x's placement on the first axis, [(param shape, its placement)], op that must run split)
CASES = {
    # pointwise families (pointwise_table.py)
    "hypot": (lambda x, p: torch.hypot(x, p), (8, 4), S(0), [((4,), R)], "hypot"),
    "copysign_fmax": (lambda x, p: torch.copysign(x, p) + torch.fmax(x, p), (8, 4), S(1), [((8, 4), S(1))], "fmax"),
    "logaddexp": (lambda x, p: torch.logaddexp(x, p) * torch.logaddexp2(x, p), (8, 4), S(0), [((4,), R)], "logaddexp"),
    "float_power": (lambda x, p: torch.float_power(x.abs() + 1, p).float(), (8, 4), S(0), [((4,), R)], "float_power"),
    "addcmul": (lambda x, p: torch.addcmul(x, p, x) * torch.addcdiv(x, x, p.exp()), (8, 4), S(1), [((4,), S(0))], "addcdiv"),
    "special": (lambda x: torch.special.erfcx(x) * torch.special.ndtr(x) + torch.special.entr(x.abs()), (8, 4), S(0), [], "special_erfcx"),
    "gamma": (lambda x: torch.lgamma(x.abs() + 1) * torch.digamma(x.abs() + 1) + torch.sinc(x), (8, 4), S(1), [], "digamma"),
    "inverse_hyperbolic": (lambda x: torch.atanh(x.tanh() * 0.5) * torch.asinh(x) + torch.acosh(x.abs() + 1.5), (8, 4), S(0), [], "atanh"),
    "rsub_deg2rad": (lambda x, p: torch.rsub(x, p) * torch.deg2rad(x), (8, 4), S(0), [((8, 4), S(0))], "rsub"),
    # reductions with dims (reductions_dims.py)
    "var_std_dim": (lambda x: (x.var(dim=1, unbiased=False) * x.std(dim=1)).unsqueeze(1) * x, (8, 4), S(0), [], "var"),
    "var_mean": (lambda x: torch.var_mean(x, dim=0, keepdim=True)[0] * x, (8, 4), S(1), [], "var_mean"),
    "median_mode": (lambda x: (x.median(dim=1).values * x.mode(dim=1).values).unsqueeze(1) * x, (8, 4), S(0), [], "mode"),
    "kthvalue": (lambda x: x.kthvalue(2, dim=0, keepdim=True).values * x, (8, 4), S(1), [], "kthvalue"),
    "nansum_split_dim": (lambda x: x.nansum(dim=0) + x.nanmean(dim=1).sum(), (8, 4), S(0), [], "nansum"),
    # matrix ops (matrix.py)
    "addmm": (lambda x, b, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0), (8, 4), S(0), [((6,), R), ((4, 6), R)], "addmm"),
    "addmm_columns": (lambda x, b, w: torch.addmm(b, x, w, beta=0.5), (8, 4), S(0), [((8,), S(0)), ((4, 8), S(1))], "addmm"),
    "addmm_contracted_beta0": (lambda x, b, w: torch.addmm(b, x, w, beta=0), (8, 4), S(1), [((8, 6), R), ((4, 6), S(0))], "addmm"),
    "addmv_mv": (lambda x, b, v: torch.addmv(b, x, v) * torch.mv(x, v), (8, 4), S(0), [((8,), S(0)), ((4,), R)], "addmv"),
    "addr": (lambda x, b, v: torch.addr(b, x, v), (8,), S(0), [((8, 6), S(0)), ((6,), R)], "addr"),
    "dot": (lambda x, v: torch.dot(x, v), (8,), S(0), [((8,), S(0))], "dot"),
    "addbmm": (lambda x, b, b2: torch.addbmm(b, x, b2), (4, 8, 4), S(1), [((8, 6), S(0)), ((4, 4, 6), R)], "addbmm"),
    "bilinear": (lambda x, x2, w, b: F.bilinear(x, x2, w, b), (8, 4), S(0), [((8, 3), S(0)), ((6, 4, 3), R), ((6,), R)], "bilinear"),
    # views and scatters (views_scatter.py)
    "flip_roll_rot90": (lambda x: x.flip(1) + x.roll(1, 1) + x.rot90(1, (2, 1)), (8, 4, 4), S(0), [], "rot90"),
    "diagonal_diag_embed": (lambda x: torch.diag_embed(x.diagonal(0, 1, 2)).sum(-1), (8, 4, 4), S(0), [], "diag_embed"),
    "unfold_windows": (lambda x: x.unfold(1, 2, 1).sum(-1), (8, 4), S(0), [], "unfold"),
    "slice_scatter": (lambda x, s: torch.slice_scatter(x, s, dim=1, start=0, end=2), (8, 4), S(0), [((8, 2), S(0))], "slice_scatter"),
    "select_scatter": (lambda x, s: torch.select_scatter(x, s, 1, 3), (8, 4), S(0), [((8,), S(0))], "select_scatter"),
    "diagonal_scatter": (lambda x, s: torch.diagonal_scatter(x, s, 0, 1, 2), (8, 4, 4), S(0), [((8, 4), S(0))], "diagonal_scatter"),
    "copy_views": (lambda x: torch.permute_copy(x, (1, 0)).t() * torch.msort(x), (8, 4), S(1), [], "msort"),
    "copy_views_mT_movedim_hsplit": (lambda x: torch.hsplit(x, 2)[0] * torch.movedim(x[:, 2:].mT.mT, 1, 0).t(), (8, 4), S(0), [], "hsplit"),
    # Fourier transforms (spectral.py)
    "rfft": (lambda x: torch.fft.rfft(x, dim=1).abs(), (8, 4), S(0), [], "fft_rfft"),
    # layers (nn_extra.py) and native norms (norms_native.py)
    "conv_transpose": (lambda x, w: F.conv_transpose1d(x, w), (8, 4, 6), S(0), [((4, 3, 3), R)], "conv_transpose1d"),
    "conv_transpose_channels": (lambda x, w, b: F.conv_transpose1d(x, w, b), (2, 4, 6), R, [((4, 8, 3), S(1)), ((8,), S(0))], "conv_transpose1d"),
    "max_unpool": (lambda x: F.max_unpool1d(*F.max_pool1d(x, 2, return_indices=True), 2), (8, 4, 6), S(0), [], "max_unpool"),
    "grid_sample": (lambda x, g: F.grid_sample(x, g.tanh(), align_corners=False), (4, 4, 3, 3), S(0), [((4, 2, 2, 2), S(0))], "grid_sampler"),
    "glu_prelu": (lambda x, w: F.prelu(F.glu(x, dim=1), w), (8, 4), S(0), [((2,), R)], "glu"),
    "kl_div": (lambda x, t: F.kl_div(x.log_softmax(-1), t.softmax(-1), reduction="sum"), (8, 4), S(0), [((8, 4), S(0))], "kl_div"),
    "tensordot": (lambda x, w: torch.tensordot(x, w, dims=([1], [0])), (8, 4), S(0), [((4, 6), R)], "tensordot"),
    "cdist": (lambda x, y: torch.cdist(x, y), (8, 4), S(0), [((6, 4), R)], "cdist"),
    "native_batch_norm": (lambda x, w, b: torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)[0], (4, 8, 3), S(1), [((8,), S(0)), ((8,), S(0))], "native_batch_norm"),
    "native_group_norm_batch": (lambda x, w, b: torch.native_group_norm(x, w, b, 8, 4, 3, 2, 1e-5)[0], (8, 4, 3), S(0), [((4,), R), ((4,), R)], "native_group_norm"),
    "native_group_norm_groups": (lambda x, w, b: torch.native_group_norm(x, w, b, 2, 8, 3, 4, 1e-5)[0], (2, 8, 3), S(1), [((8,), S(0)), ((8,), S(0))], "native_group_norm"),
    "tril_triu_rows": (lambda x: torch.tril(x, 1) + torch.triu(x, -2), (8, 8), S(0), [], "tril"),
    "tril_triu_columns": (lambda x: torch.tril(x, -1) * torch.triu(x, 2), (8, 8), S(1), [], "triu"),
    "einsum_three_operands": (lambda x, a, b: torch.einsum("ij,jk,k->i", x, a, b), (8, 4), S(0), [((4, 6), R), ((6,), R)], "einsum"),
    "trapezoid": (lambda x, t: torch.trapezoid(x, t, dim=1) + torch.cumulative_trapezoid(x, dim=1).sum(1), (8, 4), S(0), [((8, 4), S(0))], "trapezoid"),
    "margin_losses": (lambda x, t: F.multi_margin_loss(x, t.argmax(1)) + F.triplet_margin_loss(x, t, x.flip(1)), (8, 4), S(0), [((8, 4), S(0))], "multi_margin_loss"),
}  # fmt: skip


def _placed(p, mesh: ap.Mesh):
    return ap.place(*([p] + [R] * (mesh.ndim - 1)))


@pytest.mark.parametrize("name", list(CASES))
def test_family_rule_runs_split_and_matches_serial(name):
    fn, shape, x_place, params, op_name = CASES[name]
    torch.manual_seed(0)
    model = Ops(fn, shape, [s for s, _ in params])
    x = torch.randn(shape)
    for spec in RULE_MESHES:
        mesh = spec.mesh()
        ann = {"x": _placed(x_place, mesh)} | {f"params.{i}": _placed(p, mesh) for i, (_, p) in enumerate(params)}
        plan = ap.plan(model, mesh, args=(x,), annotations=ann, strict=True)
        node = next((n for n in plan.graph.nodes if n.op == "call_function" and op_name in str(n.target)), None)
        assert node is not None, f"no {op_name} in the traced graph:\n{plan.graph}"
        assert not plan.layout(node.name).spec[0].is_replicate(), f"{node.target} ran replicated on {mesh}:\n{plan}"
        plan.check(x)
