"""Core bugs the fuzzer found, each kept as a regression test."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.sharding.rules import TensorMeta
from autopar.trace.export import trace
from fuzz.spec import run_case

CASES = {
    # gradflow: a batch-split value gathered for a colwise layer on the same axis feeds split
    # compute; its gradient arrives in parts and needed "f" after the all-gather.
    "gathered_input_of_split_compute": {
        "seed": 3,
        "vocab": 0,
        "d": 4,
        "batch": 2,
        "seq": 2,
        "blocks": [{"kind": "linear", "out": 4}, {"kind": "linear", "out": 4}],
        "mesh": [[2], ["a0"]],
        "dp": "a0",
        "annotations": [["blocks.0", "colwise", "a0"], ["blocks.1", "colwise", "a0"]],
    },
    # propagate: getitem (of split) did not follow its source, so q/k/v counted as
    # parameter-derived, needing no gradient: their gradients were left in parts.
    "getitem_of_split_needs_grad": {
        "seed": 3,
        "vocab": 0,
        "d": 4,
        "batch": 2,
        "seq": 2,
        "blocks": [{"kind": "attn", "heads": 1}],
        "mesh": [[2], ["a0"]],
        "dp": "a0",
        "annotations": [["blocks.0.proj", "colwise", "a0"]],
    },
    # propagate: a dynamic dim (batch 2) was split over an axis of 3, leaving a rank empty.
    "dynamic_dim_indivisible_at_example": {
        "seed": 927,
        "vocab": 0,
        "d": 6,
        "batch": 2,
        "seq": 2,
        "blocks": [{"kind": "attn", "heads": 2}, {"kind": "linear", "out": 4, "bias": True}, {"kind": "norm"}],
        "mesh": [[1, 3], ["a0", "a1"]],
        "dp": "a0",
        "annotations": [
            ["blocks.0.qkv", "colwise", "a1"],
            ["blocks.0.proj", "rowwise", "a0"],
            ["blocks.1", "rowwise", "a1"],
        ],
    },
    # check: a model without trainable parameters (the gradient step must be skipped).
    "no_parameters": {
        "seed": 186,
        "vocab": 0,
        "d": 12,
        "batch": 8,
        "seq": 2,
        "blocks": [{"kind": "act", "fn": "gelu"}],
        "mesh": [[3], ["a0"]],
        "dp": None,
        "annotations": [["x", "place", [None]]],
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fuzz_case(name):
    assert run_case(CASES[name]) == "ok"


def test_dims_specialised_by_export_are_static():
    """export turns a feature dim into a SymInt with a constant value; it is not dynamic."""
    traced = trace(nn.Linear(6, 4), (torch.randn(8, 6),))
    x = next(n for n in traced.gm.graph.nodes if n.name in traced.user_inputs)
    meta = TensorMeta.of(x.meta["val"])
    assert meta.shape == (8, 6) and meta.dynamic == (True, False)


def test_guard_refuses_the_global_batch_on_a_static_split_dim():
    plan = ap.plan(
        nn.Linear(6, 4), ap.Mesh((2,), ("tp",)), args=(torch.randn(8, 6),), annotations={"input": ap.place(ap.Shard(1))}
    )
    with pytest.raises(ap.InputError, match="global input was passed"):
        plan.module(0)(torch.randn(8, 6))
