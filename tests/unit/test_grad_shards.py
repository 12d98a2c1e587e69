"""The storage protocol's ``grad_shards``: the ZeRO level that steps slices of the gradient buckets
answers it, and the code outside data parallel's folder (the gradient sync, ap.Optimizer,
ap.GradScaler, checkpoints) reaches ZeRO 1-2 only through it and the optimizer it makes."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.parallel.protocols.storage import GradShards, SlicedOptimizer
from tests.harness import data_parallel as H


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_only_zero_1_and_2_step_slices_and_only_2_reduce_scatters(zero):
    shards = ap.DataParallel("dp", zero=zero).grad_shards()
    if zero in (1, 2):
        assert isinstance(shards, GradShards) and shards.reduce_scatters == (zero == 2)
        assert shards is not ap.DataParallel("dp", zero=zero).grad_shards()  # one per gradient sync
    else:
        assert shards is None


@pytest.mark.parametrize("zero", [1, 2])
def test_the_shards_optimizer_is_a_sliced_optimizer_whose_slices_lie_in_the_parameters(zero):
    plan = H.make_plan("dp2").with_data_parallel(ap.DataParallel("dp", zero=zero, bucket_max_params=3))
    module = plan.module(1)
    sync = module.autopar_grad_sync
    assert sync.modes[0] == ("reduce_scatter" if zero == 2 else "all_reduce")
    opt = ap.Optimizer(module, torch.optim.AdamW, lr=1e-3)
    assert isinstance(opt.inner, SlicedOptimizer) and opt.inner.module is module
    assert sync.shards.stepped_by is opt.inner  # the sync's check sees the optimizer
    slices = opt.inner.param_slices()
    assert slices and set(slices) == set(sync.shards.slice_tensors(sync.shards.sliced_names()))
    for piece, (param, start) in slices.items():
        # the slice is the parameter's flattened elements from ``start`` (checkpoints rely on it)
        assert piece.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
        assert torch.equal(piece, param.detach().reshape(-1)[start : start + piece.numel()])


def test_a_plain_optimizer_on_zero_2_is_refused_by_the_shards_saying_what_to_use():
    plan = H.make_plan("dp2").with_data_parallel(ap.DataParallel("dp", zero=2))
    shards = plan.module(0).autopar_grad_sync.shards
    with pytest.raises(ap.DataParallelError, match=r"ap.Optimizer\(module, torch.optim.AdamW"):
        shards.check_stepped()
