"""Expert parallelism on 4 real gloo processes (jobs in jobs_experts.py): tokens dispatched to
their experts' ranks by all-to-all (variable sizes, one expert without a token), 3 AdamW steps
equal serial, each rank holding 1/dp of the experts (stacked, or a per-expert ModuleList's)."""

from __future__ import annotations

import pytest

from tests.harness import moe as M
from tests.harness import moe_lists as L


@pytest.mark.parametrize(
    "kind,shape,routed,expert_tp",
    [
        ("mixtral", (4,), True, False),
        ("qwen3_moe", (2, 2), True, False),
        ("mixtral", (2, 2), False, False),
        ("mixtral", (2, 2), False, True),
        ("mixtral_list", (4,), True, False),
        ("mixtral_list", (2, 2), True, True),
    ],
    ids=[
        "mixtral-routed-dp4",
        "qwen3-routed-dp2xtp2",
        "mixtral-model-dp2xtp2",
        "mixtral-expert-tp-dp2xtp2",
        "mixtral-modulelist-routed-dp4",
        "mixtral-modulelist-expert-tp-dp2xtp2",
    ],
)
def test_real_gloo_dispatch_equals_serial(gloo, kind, shape, routed, expert_tp):
    results = gloo(4).run("tests.gloo.jobs_experts:three_adamw_steps", kind, shape, routed, expert_tp, timeout=300)
    assert results[0][0] < 2e-5, results[0][0]  # whole models with AdamW's eps 1e-3: no top-k flip, no eps-scale step
    listed = kind.endswith("_list")  # a per-expert ModuleList: expert i's tensors whole on its rank
    model = (L.RoutedListExperts(kind[:-5]) if listed else M.RoutedExperts(kind)) if routed else M.moe_model(kind)[0]
    full = sum(p.numel() for n, p in model.named_parameters() if "experts." in n)
    share = shape[0] * (2 if expert_tp else 1)  # 1/dp of the experts, each split over tp too
    assert all(held == full // share for _, held, _ in results), [r[1] for r in results]
    assert all("all_to_all" in kinds and "all_gather" not in kinds for _, _, kinds in results), results


def test_list_experts_checkpoint_keeps_serial_names(gloo, tmp_path):
    """DCP of a ModuleList's experts split over dp=4 (each whole on its rank): the serial names,
    loaded into a plain serial state dict and into a dp=2 plan, the same tensors."""
    path = str(tmp_path / "ck")
    saved = gloo(4).run("tests.gloo.jobs_experts:list_experts_save", path, timeout=300)
    assert all(same and worst == 0 for same, worst in saved), saved
    assert gloo(2).run("tests.gloo.jobs_experts:list_experts_load", path, timeout=300) == [0, 0]


# the list experts compiled (14 s) run in `make fuzz`; the stacked ones cover the compiled dispatch in CI
@pytest.mark.parametrize("kind", ["mixtral", pytest.param("mixtral_list", marks=pytest.mark.slow)])
def test_compiled_rank_module_equals_eager_and_serial(gloo, kind):
    """torch.compile of a rank module with the experts dispatched (stacked or a ModuleList): the
    eager numbers, the serial gradients; graph breaks at the data-dependent sizes (the counts, the
    all-to-alls' row counts, a ModuleList's split by expert): docs/experts.md gives the counts."""
    results = gloo(4).run("tests.gloo.jobs_experts:compiled_step", kind, timeout=300)
    for vs_eager, vs_serial, breaks, graphs in results:
        assert vs_eager < 1e-6 and vs_serial < 1e-5, results
        assert breaks and graphs > 1, results
    print(kind, results[0][2], results[0][3])


@pytest.mark.parametrize("axis", ["b", "a"], ids=["inner", "outer"])
def test_real_gloo_dispatch_on_one_of_two_dp_axes(gloo, axis):
    """The batch over (a, b) = (2, 2), the experts over b: each rank's all-to-alls run on its
    group of b (the ranks sharing its a coordinate), the experts' gradients are all-reduced over
    a; over a, the other way round; 3 AdamW steps equal serial; a rank holds half of the experts."""
    results = gloo(4).run("tests.gloo.jobs_experts:sub_axis_three_adamw_steps", "mixtral", axis, timeout=300)
    assert results[0][0] < 2e-5, results[0][0]
    full = sum(p.numel() for n, p in M.RoutedExperts("mixtral").named_parameters() if "experts." in n)
    assert all(held == full // 2 for _, held, _ in results), [r[1] for r in results]
    for rank, (_, _, groups) in enumerate(results):
        b_group, a_group = (0, 1) if rank < 2 else (2, 3), (rank % 2, rank % 2 + 2)
        dispatch, replicas = (b_group, a_group) if axis == "b" else (a_group, b_group)
        assert {g for kind, g in groups if kind == "all_to_all"} == {dispatch}, groups
        assert ("all_reduce", replicas) in groups, groups
    print("max relative difference from serial", results[0][0])


def test_sub_axis_experts_checkpoint(gloo, tmp_path):
    """DCP of experts split within the groups of b (replicated over a): the serial tensors, and
    the same pieces on every rank when loaded into a fresh plan of that layout."""
    results = gloo(4).run("tests.gloo.jobs_experts:sub_axis_checkpoint", str(tmp_path / "ck"), timeout=300)
    assert all(same and worst == [0, 0] and local_ok for same, worst, local_ok in results), results
