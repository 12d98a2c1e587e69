"""Rules for ops of transformer variants against serial (forward and every gradient) on (2,),
(4,) and (2, 2): baddbmm (Bloom's ALiBi scores), expand_as, view_as, repeat, repeat_interleave,
einsum, index_put / index_put_, scatter_ / scatter_add_, log_sigmoid, to.dtype_layout, concat, rsub, reshape_as,
view_as_complex / view_as_real, hardswish and more elementwise ops; in-place
copies into views of an empty tensor keep writing into it (MLA keys)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar as ap
from tests.simulated.test_rules import run_case, three

S, R = ap.Shard, ap.Replicate()
PUT_ROWS = torch.tensor([1, 4])


def _index_put(x):
    y = x.clone()
    y[PUT_ROWS] = x[:2] * 3  # index_put_
    y = y + x.index_put((torch.tensor([0, 0]),), x[6:], accumulate=True)
    y = y + x.index_put((torch.tensor([7]),), torch.ones(1, 1))  # values broadcast on the split dim
    return y + x.index_put((x > 0,), torch.zeros(1))  # a boolean mask indexes every dim


def _write_into_empty(x):
    """MLA's keys (DeepSeek-V3 family): an empty tensor filled through in-place copies into
    views of it; the writes must reach the tensor, whatever the layouts of the sources."""
    k = x.new_empty(8, 6)
    k[:, :4].copy_(x)
    k[:, 4:].copy_(x[:, :2] * 2)
    return k * 1.5


CASES = {
    "baddbmm": (
        lambda x, b1, b2: torch.baddbmm(x, b1, b2, beta=0.5, alpha=2.0),
        (4, 4, 5),
        three((S(0),), (S(0),), (S(0), S(1))),
        [(4, 4, 6), (4, 6, 5)],
    ),
    "baddbmm_broadcast_bias": (
        lambda x, b1, b2: torch.baddbmm(x, b1, b2),
        (4, 1, 6),
        three((S(0),), (S(0),), (S(0), S(2))),
        [(4, 3, 6), (4, 6, 6)],
    ),
    "baddbmm_split_k_beta0": (
        lambda x, b1, b2: torch.baddbmm(b1[..., :5], x, b2, beta=0.0),
        (4, 3, 8),
        three((S(2),), (S(2),), (S(0), S(2))),
        [(4, 3, 6), (4, 8, 5)],
    ),
    "expand_as": (lambda x, o: x.expand_as(o) * o, (4, 1, 6), three((S(0),), (S(0),), (S(0), S(2))), [(4, 3, 6)]),
    "view_as": (lambda x, o: x.view_as(o) * o, (4, 8), three((S(0),), (S(0),), (S(0), S(1))), [(4, 2, 4)]),
    "repeat": (lambda x: x.repeat(2, 1, 3)[:, :4, :4] * 2, (4, 4, 2), three((S(0),), (S(1),), (S(0), S(1)))),
    "to_dtype_layout": (
        lambda x: torch.ops.aten.to.dtype_layout(x, dtype=torch.float64).float().sum(0),
        (4, 4),
        three((S(1),), (S(1),), (S(0), S(1))),
    ),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=1) * 2, (4, 4), three((S(0),), (S(0),), (S(0), R))),
    "einsum_batch": (
        lambda x, w: torch.einsum("bhd,hde->bhe", x, w),
        (4, 4, 2),
        three((S(0),), (S(1),), (S(0), S(1))),
        [(4, 2, 6)],
    ),
    "einsum_contracted": (
        lambda x, w: torch.einsum("bd,de->be", x, w),
        (4, 8),
        three((S(1),), (S(1),), (S(0), S(1))),
        [(8, 6)],
    ),
    "scatter_inplace": (
        lambda x: (
            torch.zeros(8, 4).scatter_(1, x.argmax(1, keepdim=True), 1.0) * x
            + torch.zeros(8, 4).scatter_add_(1, x.argmin(1, keepdim=True), x[:, :1])
        ),
        (8, 4),
        three((S(0),), (S(0),), (S(0), R)),
    ),
    "log_sigmoid": (lambda x: torch.nn.functional.logsigmoid(x), (8, 4), three((S(0),), (S(1),), (S(0), S(1)))),
    "copy_into_views": (_write_into_empty, (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    "concat": (lambda x: torch.concat([x, x * 2], dim=1), (8, 4), three((S(0),), (S(0),), (S(0), R))),
    "complex_rotary": (
        lambda x, f: torch.view_as_real(torch.view_as_complex(x.reshape(8, 2, 2)) * torch.view_as_complex(f)).flatten(
            1
        ),
        (8, 4),
        three((S(0),), (S(0),), (S(0), R)),
        [(8, 2, 2)],
    ),
    "rsub_reshape_as": (
        lambda x, o: (1.0 - x).reshape_as(o) * o,
        (4, 8),
        three((S(0),), (S(0),), (S(0), S(1))),
        [(4, 2, 4)],
    ),
    "hard_activations": (
        lambda x: (
            F.hardswish(x)
            + F.hardsigmoid(x) * torch.atan2(x, x.abs() + 1)
            + F.relu6(x)
            + torch.lerp(x, x.sinh(), 0.3)
            + torch.remainder(x, 0.7)
            - torch.nn.functional.selu(x)
        ),
        (8, 4),
        three((S(0),), (S(1),), (S(0), S(1))),
    ),
    "arithmetic_aliases": (
        lambda x: torch.subtract(torch.multiply(x, 2.0), torch.divide(x, x.abs() + 1)),
        (8, 4),
        three((S(0),), (S(1),), (S(0), S(1))),
    ),
    "index_put": (_index_put, (8, 4), three((S(1),), (S(1),), (S(1), R))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_matches_serial(name):
    fn, shape, placements, *extra = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to gathered-and-replicated
        run_case(fn, shape, placements, extra[0] if extra else ())
