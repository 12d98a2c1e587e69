"""Core bugs the fuzzer found, each kept as a regression test."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.sharding.rules import TensorMeta
from autopar.trace.export import trace
from fuzz.spec import plan_case, run_case

MOE_PLAIN = {  # fuzz/moe.py: stacked 3-D experts, one up projection, expert biases
    "kind": "moe",
    "experts": 4,
    "top_k": 1,
    "ffn": 5,
    "form": "stacked",
    "bias": True,
    "router": "topk_softmax",
    "renorm": True,
    "layout": "plain",
}
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
    # issue 26, propagate: a batch of 7 on 2 ranks (ragged: cut unevenly at run time) left the
    # experts op no strategy with its tokens split (its lowering was not marked as sizing itself
    # from its own rows): a ShardingError unannotated, tokens gathered around the experts annotated.
    "moe_ragged_batch_plain_dp": {
        "seed": 7,
        "vocab": 0,
        "d": 8,
        "batch": 7,
        "seq": 2,
        "blocks": [MOE_PLAIN, {"kind": "residual", "hidden": 5, "fn": "silu"}],
        "mesh": [[2], ["a0"]],
        "dp": "a0",
        "annotations": [],
    },
    # issue 52, emit: a column-parallel Linear on the load-balanced context-parallel axis split its
    # output by the weight's rows (plain pieces), and the output's all-gather rejoined them as if
    # zig-zag: off by 1.66. Now every split on the axis knows its order (sharding/piece_order.py).
    "colwise_on_zigzag_cp_axis": {
        "seed": 1770,
        "vocab": 13,
        "d": 8,
        "batch": 7,
        "seq": 4,
        "blocks": [{"kind": "bn"}, {"kind": "act", "fn": "silu"}, {"kind": "linear", "out": 12, "bias": True}],
        "mesh": [[4, 2, 1], ["a0", "a1", "a2"]],
        "dp": None,
        "annotations": [["embed", "rowwise", "a0"], ["blocks.2", "colwise", "a1"]],
        "checkpoint": "full",
        "offload": False,
        "cp": ["a1", "ring", True],
    },
    # issue 52, emit: a vocabulary-parallel embedding on the zig-zag axis was planned and then
    # refused while emitting (its lowering reads one range of rows): the weight's rows are plain.
    "vocab_embedding_on_zigzag_cp_axis": {
        "seed": 1024,
        "vocab": 12,
        "d": 4,
        "batch": 8,
        "seq": 4,
        "blocks": [{"kind": "attn", "heads": 4}],
        "mesh": [[2, 2], ["a0", "a1"]],
        "dp": "a0",
        "annotations": [
            ["blocks.0.qkv", "colwise", "a0"],
            ["embed", "rowwise", "a1"],
            ["blocks.0.proj", "colwise", "a0"],
        ],
        "zero": 3,
        "checkpoint": "selective",
        "offload": True,
        "cp": ["a1", "allgather", True],
        "fold": True,
    },
    # issue 47: the fuzzer draws Ulysses, hybrid and packed documents (fuzz/strategies.long_context);
    # hybrid ring + Ulysses load balanced over two axes, documents of 8 positions masked from global
    # positions (each layer reads the one mask: Ulysses gathers its rows once), checkpointed
    "hybrid_ulysses_ring_packed_documents": {
        "seed": 47,
        "vocab": 12,
        "d": 8,
        "batch": 2,
        "seq": 16,
        "blocks": [
            {"kind": "attn", "heads": 2, "doc": 8},
            {"kind": "residual", "hidden": 8, "fn": "gelu"},
            {"kind": "attn", "heads": 2, "doc": 8},
        ],
        "mesh": [[2, 2], ["a0", "a1"]],
        "dp": None,
        "annotations": [],
        "checkpoint": "full",
        "offload": False,
        "cp": [["a0", "a1"], ["ring", "ulysses"], True],
    },
    # issue 47: Ulysses on cp with tp's head split on the other axis and ZeRO-3 on dp (a third axis)
    "ulysses_with_tp_heads_and_zero3": {
        "seed": 48,
        "vocab": 0,
        "d": 8,
        "batch": 4,
        "seq": 8,
        "blocks": [{"kind": "attn", "heads": 4, "doc": 4}, {"kind": "norm"}],
        "mesh": [[2, 2, 2], ["a0", "a1", "a2"]],
        "dp": "a0",
        "annotations": [["blocks.0.qkv", "colwise", "a1"], ["blocks.0.proj", "rowwise", "a1"]],
        "zero": 3,
        "checkpoint": None,
        "cp": ["a2", "ulysses", True],
    },
    # issue 52's 2,000-case run, fsdp: experts of a ModuleList split over a0 under zero=3 on a1 (a
    # one-rank shard group): another rank's expert is an empty piece on every rank of the group,
    # and merging its gradient concatenated nothing.
    "listed_experts_empty_piece_under_zero3": {
        "seed": 178527,
        "vocab": 13,
        "d": 4,
        "batch": 3,
        "seq": 2,
        "blocks": [
            {
                "kind": "moe",
                "experts": 4,
                "top_k": 1,
                "ffn": 6,
                "form": "list",
                "bias": False,
                "router": "softmax_topk",
                "renorm": False,
            },
            {"kind": "residual", "hidden": 7, "fn": "gelu"},
        ],
        "mesh": [[4, 1], ["a0", "a1"]],
        "dp": "a1",
        "annotations": [["blocks.0.experts", "expert", ["a0", None]]],
        "zero": 3,
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


def test_moe_ragged_batch_dispatched():
    """The same model with its experts on the batch's axis: dispatched by all-to-all, no gather."""
    case = dict(CASES["moe_ragged_batch_plain_dp"], annotations=[["blocks.0.experts", "expert", ["a0", None]]])
    plan, _ = plan_case(case)
    kinds = {c.kind for c in plan.collectives() if c.node.startswith("moe")}
    assert kinds == {"all_to_all"}, kinds
    assert run_case(case) == "ok"


def test_moe_trace_reused_by_a_sub_axis_plan():
    """parallel/experts/blocks.py: a trace collapsed by an earlier plan (the fuzzer's cache, the search's probes)
    kept that plan's split of the experts; a later plan over one part of a two-axis data
    parallelism (Shard(0, within=2)) found no strategy ("no collective turns S(0,within=2) into R")."""
    base = dict(CASES["moe_ragged_batch_plain_dp"], batch=8, mesh=[[2, 2], ["a0", "a1"]], dp="a1")
    assert run_case(dict(base, annotations=[["blocks.0.experts", "expert", ["a1", None]]])) == "ok"
    for on in ("a1", "a0"):  # the inner part (within), the outer (across), on the same cached trace
        ann = [["blocks.0.experts", "expert", [on, None]]]
        assert run_case(dict(base, dp_replicate="a0", annotations=ann)) == "ok"


MOE_LIST = dict(MOE_PLAIN, form="list", experts=4, ffn=4, bias=False, layout=None)


def test_moe_list_trace_reused_after_another_plan():
    """parallel/experts/blocks.py: a ModuleList collapsed by an earlier plan on the cached trace was not found
    again (its items' nodes are gone), so a later plan kept that plan's expert tensor parallelism
    (each expert's w1 (4, 8) stored as (4, 4) and multiplied with whole rows: "mat1 and mat2 shapes
    cannot be multiplied"); the fuzzer met it after a plan refused for its tp split."""
    base = dict(CASES["moe_ragged_batch_plain_dp"], d=8, blocks=[MOE_LIST], mesh=[[2, 2], ["a0", "a1"]], dp="a1")
    assert run_case(dict(base, annotations=[["blocks.0.experts", "expert", ["a1", "a0"]]])) == "ok"  # tp on a0
    assert run_case(dict(base, annotations=[["blocks.0.experts", "expert", ["a1", None]]])) == "ok"
    assert run_case(dict(base, annotations=[])) == "ok"


@pytest.mark.parametrize("experts", [2, 3])
def test_moe_experts_over_a_part_of_few_ranks(experts):
    """Two experts over the inner or outer part of a (2, 2) two-axis data parallelism: propagate
    judged S(0, within=2) by the merged axis' 4 ranks (2 experts: "uneven") and offered no strategy
    ("no collective turns S(0,within=2) into R"). A part of one rank (the other axis of 4) named a
    process group of one rank that does not exist; a part of every rank (the other axis of 1) was
    refused as groups as large as the axis: now the experts whole on each rank, or split over all."""
    moe = dict(MOE_PLAIN, experts=experts)
    base = dict(CASES["moe_ragged_batch_plain_dp"], batch=8, blocks=[moe], dp="a1", dp_replicate="a0")
    meshes = [[[2, 2], ["a0", "a1"]]] if experts == 2 else [[[4, 1], ["a0", "a1"]], [[1, 4], ["a0", "a1"]]]
    for mesh in meshes:
        for on in ("a0", "a1"):
            case = dict(base, mesh=mesh, annotations=[["blocks.0.experts", "expert", [on, None]]])
            refused = experts == 3 and (mesh[0][0] if on == "a0" else mesh[0][1]) == 4
            assert run_case(case).startswith("AnnotationError") if refused else run_case(case) == "ok", (mesh, on)


def test_experts_split_twice_with_a_dispatch_refused_while_planning():
    """issue 52: a plan ap.plan accepted was refused while its program was emitted (experts split
    on two axes, a dispatch on one): lowerings now say so while planning (Lowering.refusal)."""
    case = {
        "seed": 7,
        "vocab": 0,
        "d": 8,
        "batch": 7,
        "seq": 2,
        "blocks": [
            {
                "kind": "moe",
                "experts": 4,
                "top_k": 2,
                "ffn": 4,
                "form": "list",
                "bias": True,
                "router": "topk_softmax",
                "renorm": True,
            },
            {"kind": "residual", "hidden": 5, "fn": "silu"},
        ],
        "mesh": [[4, 2, 1], ["a0", "a1", "a2"]],
        "dp": None,
        "annotations": [["x", "place", [0, None, None]], ["blocks.0.experts", "expert", ["a1", "a0"]]],
        "checkpoint": None,
    }
    assert run_case(case).startswith("ShardingError: moe_experts at")


# The fuzzer's bf16 mode on plans with no data parallelism (ap.MixedPrecision) and with MoE
# experts: expert_parallel's tp check summed the bf16 trace's pieces against the whole at fp32's
# tolerance and refused a correct column- then row-parallel split ("the pieces' sum differs").
BF16_EXPERTS_TP = {
    "seed": 7,
    "vocab": 0,
    "d": 8,
    "batch": 7,
    "seq": 2,
    "blocks": [
        {"kind": "moe", "experts": 4, "top_k": 2, "ffn": 4, "form": "list", "bias": True}
        | {"router": "topk_softmax", "renorm": True},
        {"kind": "residual", "hidden": 5, "fn": "silu"},
    ],
    "mesh": [[2, 2], ["a0", "a1"]],
    "dp": None,
    "annotations": [["blocks.0.gate", "colwise", "a1"], ["blocks.0.experts", "expert", ["a0", "a1"]]],
    "checkpoint": None,
    "cp": ["a1", "ring", False],
}


def test_bf16_mode_on_experts_split_by_tp_without_data_parallel():
    from fuzz.user_modes import check_bf16

    plan, args = plan_case(BF16_EXPERTS_TP, rng="placement")
    assert plan.data_parallel is None
    check_bf16(BF16_EXPERTS_TP, plan, args)  # raises on a wrong number (and refused before the fix)
