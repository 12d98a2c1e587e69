"""Uneven pieces on real gloo processes (issue 24): vocabulary 67 and sequence 7 on tp=4 and
on dp=2 x tp=2 (pieces 17,17,17,16 of the vocabulary; 2,2,2,1 of the sequence) train like serial:
the padded all-gathers and reduce-scatters move equal sizes over gloo."""

from __future__ import annotations

import pytest

CASES = [
    (4, (4,), ("tp",), "megatron_vocab"),
    (4, (4,), ("tp",), "sequence_parallel"),
    (4, (2, 2), ("dp", "tp"), "sequence_parallel"),
]


@pytest.mark.parametrize("world,shape,axes,annotations", CASES)
def test_uneven_gpt_trains_like_serial_over_gloo(gloo, world, shape, axes, annotations):
    results = gloo(world).run("tests.gloo.jobs_uneven:uneven_gpt_trains_like_serial", shape, axes, annotations)
    for r in results:
        assert r["max_rel_param"] < 1e-5, r
        assert r["losses"] == pytest.approx(r["serial"], rel=1e-5)
