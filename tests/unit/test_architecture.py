"""The package's shape: public names, one planning pipeline, options, techniques, lowerings and
redistribution step kinds as the extension points docs/architecture.md describes."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import autopar as ap
from autopar.sharding.lowerings.base import LOWERINGS, Lowering, register_lowering
from autopar.placement import Partial, Replicate, Shard
from autopar.runtime.ring import ring_bytes
from autopar.sharding.redistribute import STEP_KINDS, plan_steps
from tests.harness.models import MLP, MLP_TP


def test_public_names_sorted_and_resolvable():
    assert ap.__all__ == sorted(ap.__all__)
    for name in ap.__all__:
        assert getattr(ap, name) is not None


def test_deprecated_spellings_warn_and_still_work():
    with pytest.warns(DeprecationWarning, match="ap.replicated"):
        ann = getattr(ap, "replicate")()
    assert ann == ap.replicated()
    with pytest.warns(DeprecationWarning, match="ap.parallelize"), pytest.raises(ap.MeshError, match="parallelize"):
        getattr(ap, "compile")(MLP(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),))


def test_plan_options_is_one_frozen_value():
    opts = ap.PlanOptions(data_parallel="dp")
    assert opts.data_parallel == ap.DataParallel("dp") and opts.techniques == (ap.DataParallel("dp"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.strict = True
    with pytest.raises(ap.PipelineError, match="need a pipeline"):
        ap.PlanOptions(split_before=("layers.1",))


def test_plan_variants_share_trace_and_layouts():
    x = torch.randn(8, 16)
    plan = ap.plan(MLP(), ap.Mesh((2, 2), ("dp", "tp")), args=(x,), annotations=MLP_TP, data_parallel="dp")
    assert isinstance(plan.options, ap.PlanOptions)
    zero2 = plan.with_data_parallel(ap.DataParallel("dp", zero=2))
    assert zero2.traced is plan.traced and zero2.layouts is plan.layouts
    assert zero2.options.data_parallel.zero == 2 and plan.options.data_parallel.zero == 0
    with pytest.raises(ap.DataParallelError, match="plan again"):
        plan.with_data_parallel(ap.DataParallel("tp"))


def test_lowering_registry_refuses_duplicates_and_rules_use_registered_objects():
    with pytest.raises(ValueError, match="twice"):
        register_lowering(type(LOWERINGS["split_blocked"])())
    assert all(isinstance(lw, Lowering) and lw.name == name for name, lw in LOWERINGS.items())
    assert {
        "vocab_parallel_embedding",
        "cross_entropy_split_rows",
        "cross_entropy_vocab_parallel",
        "split_blocked",
    } <= set(LOWERINGS)


@pytest.mark.parametrize(
    "src,dst",
    [
        ((Shard(0),), (Replicate(),)),
        ((Partial(),), (Replicate(),)),
        ((Partial(),), (Shard(1),)),
        ((Shard(0),), (Shard(1),)),
        ((Replicate(),), (Shard(1),)),
        ((Replicate(),), (Partial(),)),
        ((Partial("sum"),), (Partial("avg"),)),
    ],
)
def test_every_step_kind_is_in_the_table_and_leaves_the_target(src, dst):
    cur = list(src)
    for st in plan_steps(src, dst):
        kind = STEP_KINDS[st.kind]
        cur[st.axis] = kind.next_placement(st)
        assert kind.forward_bytes(100.0, 4) == (ring_bytes(st.kind, 100.0, 4) if kind.communicates else 0.0)
    assert tuple(cur) == dst


def test_ring_bytes_formula():
    assert ring_bytes("all_reduce", 8.0, 4) == 12.0
    assert ring_bytes("all_gather", 8.0, 4) == 24.0
    assert ring_bytes("reduce_scatter", 8.0, 4) == 6.0 == ring_bytes("all_to_all", 8.0, 4)
    assert ring_bytes("all_reduce", 8.0, 1) == 0.0


def test_no_deprecated_names_inside_the_package():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ap.plan(
            MLP(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),), annotations={**MLP_TP, "norm": ap.replicated()}
        )


def test_building_a_rank_module_leaves_the_garbage_collector_as_found():
    import gc

    plan = ap.plan(MLP(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),), annotations=MLP_TP)
    assert gc.isenabled()
    plan.build_module(0)
    assert gc.isenabled()
    gc.disable()
    try:
        plan.build_module(1)
        assert not gc.isenabled()
    finally:
        gc.enable()
