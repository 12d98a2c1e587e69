"""Uneven pieces on real gloo processes (issue 24): vocabulary 67 and sequence 7 on tp=4 and
on dp=2 x tp=2 (pieces 17,17,17,16 of the vocabulary; 2,2,2,1 of the sequence) train like serial:
the padded all-gathers and reduce-scatters move equal sizes over gloo; a batch of 6 on dp=4 (rows
2,2,1,1, targets partly ignored) gives the serial token-weighted mean."""

from __future__ import annotations

import pytest

CASES = [
    (4, (4,), ("tp",), "megatron_vocab", False),
    (4, (4,), ("tp",), "sequence_parallel", False),
    (4, (2, 2), ("dp", "tp"), "sequence_parallel", False),
    (4, (4,), ("dp",), "none", True),  # batch 6 on dp=4: 2, 2, 1, 1 rows, any batch at run time
]


@pytest.mark.parametrize("world,shape,axes,annotations,dynamic", CASES)
def test_uneven_gpt_trains_like_serial_over_gloo(gloo, world, shape, axes, annotations, dynamic):
    job = "tests.gloo.jobs_uneven:uneven_gpt_trains_like_serial"
    results = gloo(world).run(job, shape, axes, annotations, dynamic=dynamic)
    for r in results:
        assert r["max_rel_param"] < 1e-5, r
        assert r["losses"] == pytest.approx(r["serial"], rel=1e-5)


CHECKPOINTS = [
    ((4,), ("tp",), 0, (2, 2), ("dp", "tp")),  # 17,17,17,16 rows -> 34,33 rows
    ((2, 2), ("dp", "tp"), 3, (4,), ("tp",)),  # zero=3 beside uneven tp pieces -> tp=4
]


@pytest.mark.parametrize("shape,axes,zero,load_shape,load_axes", CHECKPOINTS)
def test_uneven_pieces_checkpoint_round_trip(gloo, tmp_path, shape, axes, zero, load_shape, load_axes):
    """DCP boxes and HF safetensors of uneven pieces: full_tensor() is the serial tensor, and both
    load into another layout."""
    job = "tests.gloo.jobs_uneven:checkpoint_round_trips"
    for r in gloo(4).run(job, str(tmp_path), shape, axes, zero, load_shape, load_axes, timeout=240):
        assert r == {"full_tensor": 0.0, "dcp": 0.0, "hf": 0.0}, r


def test_ragged_batch_gathered_over_gloo(gloo):
    """A batch of 5 cut 2,1,1,1 on 4 real processes, gathered by exchanging sizes first."""
    results = gloo(4).run("tests.gloo.jobs_uneven:ragged_gather_matches_serial", 5)
    assert [r["rows"][0] for r in results] == [2, 1, 1, 1]
    for r in results:
        assert r["ragged"] and r["out"] < 1e-5 and r["grads"] < 1e-5, r
