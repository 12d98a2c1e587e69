"""A fixed subset of PyTorch's OpInfo database (issue 31) through fuzz/opinfo.py: each op's first
sample that has a dim dividing by 2, with x split on each such dim on meshes (2,) and (2, 2), must
equal serial in every rank's outputs and every input's gradient (or be refused with a PlanError),
and the ops below must keep their rules (no gathered fallback). The whole database: ``make opinfo``."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it (requirements-test.txt)

from fuzz import opinfo  # noqa: E402

# one or two ops of every family the rules cover, in op_db's names (ops whose first eligible sample
# cannot split, as a max over its only dim, are left to the whole run)
SUBSET = (
    "add", "mul", "div.no_rounding_mode", "pow", "where", "clamp", "hypot", "logaddexp", "special.entr", "lgamma",
    "sum", "mean", "var", "std_mean", "nansum", "softmax", "log_softmax",
    "mm", "bmm", "addmm", "addmv", "baddbmm", "nn.functional.linear", "nn.functional.bilinear",
    "permute", "transpose", "reshape", "flip", "unfold", "slice_scatter", "permute_copy", "movedim", "cat",
    "nn.functional.conv2d", "nn.functional.conv_transpose2d", "nn.functional.embedding",
    "nn.functional.cross_entropy", "fft.rfft", "nn.functional.prelu", "nn.functional.kl_div",
    "cdist",
)  # fmt: skip


@pytest.fixture(scope="module")
def results():
    for noisy in ("torch._export", "torch.fx.experimental.symbolic_shapes"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    return opinfo.run_ops(opinfo.eligible_ops(SUBSET), samples=1)


def test_subset_covers_every_listed_op(results):
    assert set(results) >= set(SUBSET), sorted(set(SUBSET) - set(results))


@pytest.mark.parametrize("name", SUBSET)
def test_opinfo_op_matches_serial_and_stays_split(results, name):
    cases = results[name]
    bad = [c for c in cases if c.status in opinfo.FAILURES]
    assert not bad, [(c.status, c.mesh, c.placements, c.detail) for c in bad]
    assert opinfo.op_class(cases) in ("pass", "refused"), [(c.status, c.detail) for c in cases]
