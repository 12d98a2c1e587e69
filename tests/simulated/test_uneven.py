"""Uneven pieces (issue 24): any size on any mesh, as torch.tensor_split cuts it, checked against
serial (forward and every gradient) on meshes (2,), (3,), (4,) and (2, 3): the redistribution
steps around equal-size collectives (pad, collective, trim), tensor-parallel layers on an
intermediate size of 66 on tp=4, vocab-parallel embedding and cross-entropy on odd vocabularies,
sequence parallel on an odd sequence length, and empty pieces (a dim smaller than its axis)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.placement import Replicate, Shard, merge_tensors, piece_sizes, shard_tensor
from autopar.runtime.uneven import from_padded, pad_piece, to_padded, trim_piece
from tests.harness.models import GPT_SEQUENCE_PARALLEL, GPT_VOCAB, MEGATRON, MLP, MLP_TP
from tests.harness.uneven import UNEVEN_MESHES, uneven_batch, uneven_gpt
from tests.simulated.test_rules import OpModule

R, S = Replicate(), Shard
MESH_IDS = ["x".join(map(str, s)) for s, _ in UNEVEN_MESHES]


def test_pieces_are_tensor_splits():
    assert piece_sizes(6, 4) == (2, 2, 1, 1) and piece_sizes(66, 4) == (17, 17, 16, 16)
    assert piece_sizes(2, 3) == (1, 1, 0)
    mesh = ap.Mesh((2, 3), ("dp", "tp"))
    full = torch.arange(5 * 7.0).view(5, 7)
    spec = (S(0), S(1))
    pieces = [shard_tensor(full, spec, mesh, r) for r in mesh.ranks()]
    assert [tuple(p.shape) for p in pieces] == [(3, 3), (3, 2), (3, 2), (2, 3), (2, 2), (2, 2)]
    assert torch.equal(merge_tensors(pieces, spec, mesh), full)


@pytest.mark.parametrize("size,n", [(6, 4), (66, 4), (2, 3), (5, 2), (1, 4), (7, 3)])
def test_padded_layout_round_trips(size, n):
    x = torch.randn(3, size)
    padded, c = to_padded(x, 1, size, n), -(-size // n)
    for k, piece in enumerate(x.tensor_split(n, 1)):
        mine = padded[:, k * c : (k + 1) * c]
        assert torch.equal(pad_piece(piece, 1, c), mine) and torch.equal(trim_piece(mine, 1, size, n, k), piece)
    assert torch.equal(from_padded(padded, 1, size, n), x)


# x placed on its uneven dim; the op makes the plan move it: all_to_all, all_gather, slice
STEPS = {
    "all_to_all_and_gather": (lambda x: torch.cumsum(x, 1), (4, 6), (S(1),), ()),
    "all_to_all_both_uneven": (lambda x: torch.cumsum(x, 0), (5, 6), (S(1),), ()),
    "gather_rows": (lambda x: torch.cumsum(x, 1), (5, 7), (S(0),), ()),
    "slice_of_replicated": (lambda x, b: x + b, (4, 6), (R,), [(6,)]),
    "contraction": (lambda x, w: x @ w, (4, 7), (S(1),), [(7, 5)]),
    "view_merging_split_dim": (lambda x: x.view(4, 3, 2).sum(-1), (4, 6), (S(1),), ()),
    "mean_over_split_dim": (lambda x: x.mean(1), (4, 6), (S(1),), ()),
    "softmax": (lambda x: x.softmax(1), (4, 6), (S(1),), ()),
    "empty_pieces": (lambda x: torch.tanh(x).cumsum(0), (5, 2), (S(1),), ()),
}


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("shape", [(3,), (4,)], ids=["3", "4"])
def test_redistribution_of_uneven_pieces_matches_serial(name, shape):
    fn, xshape, placements, extra = STEPS[name]
    torch.manual_seed(0)
    model, x = OpModule(fn, xshape, extra), torch.randn(xshape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op keeps its rule: no gathered fallback
        plan = ap.plan(
            model,
            ap.Mesh(shape, ("a",)),
            args=(x,),
            annotations={"x": ap.place(*placements)},
            strict=True,
            dynamic=False,
        )
    assert plan.check(x)["grads"] == len(list(model.parameters()))


@pytest.mark.parametrize("mesh", UNEVEN_MESHES, ids=MESH_IDS)
def test_mlp_with_intermediate_66(mesh):
    torch.manual_seed(0)
    model, x = MLP(d=16, hidden=66), torch.randn(6, 16)
    plan = ap.plan(
        model, ap.Mesh(*mesh), args=(x,), annotations=MLP_TP, data_parallel="dp" if len(mesh[0]) > 1 else None
    )
    assert plan.check(x)["grads"] == 10
    tp = plan.mesh.axis_names.index("tp")
    sizes = {plan.module(r).get_parameter("layers.0.fc1.weight").shape[0] for r in plan.mesh.ranks()}
    assert sizes == set(piece_sizes(66, plan.mesh.shape[tp]))


@pytest.mark.parametrize("mesh", UNEVEN_MESHES, ids=MESH_IDS)
def test_gpt_with_odd_vocabulary(mesh):
    model, batch = uneven_gpt(67), uneven_batch(67)
    dp = "dp" if len(mesh[0]) > 1 else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = ap.plan(model, ap.Mesh(*mesh), args=batch, annotations=MEGATRON | GPT_VOCAB, data_parallel=dp)
    assert plan.check(*batch)["grads"] == len(list(model.parameters()))
    assert "cross_entropy_vocab_parallel" in plan.explain("wte") or plan.explain("wte")


def test_six_ranks():
    """An odd mesh size of 6: vocabulary 67 (12,11,11,11,11,11), 4 heads of hidden 24 (the heads'
    views on 6 ranks do not line up: the plan moves them), a batch of 6."""
    model, batch = uneven_gpt(67), uneven_batch(67, batch=6)
    plan = ap.plan(model, ap.Mesh((6,), ("tp",)), args=batch, annotations=MEGATRON | GPT_VOCAB)
    assert plan.check(*batch)["grads"] == len(list(model.parameters()))


@pytest.mark.parametrize("mesh", UNEVEN_MESHES[2:], ids=MESH_IDS[2:])
def test_sequence_parallel_on_an_odd_sequence(mesh):
    """Sequence 7 on tp=4 (2,2,2,1): reduce-scatter and all-gather of uneven pieces."""
    model, batch = uneven_gpt(67), uneven_batch(67, seq=7)
    dp = "dp" if len(mesh[0]) > 1 else None
    plan = ap.plan(
        model, ap.Mesh(*mesh), args=batch, annotations=GPT_SEQUENCE_PARALLEL, data_parallel=dp, dynamic=False
    )
    assert {"reduce_scatter", "all_gather"} <= {c.kind for c in plan.collectives()}
    assert plan.check(*batch)["grads"] == len(list(model.parameters()))


def test_vocabulary_smaller_than_the_axis_gives_empty_pieces():
    """3 classes on tp=4: rank 3 holds no row of the embedding and no class of the loss."""
    model, batch = uneven_gpt(3, layers=1), uneven_batch(3, seq=4)
    plan = ap.plan(model, ap.Mesh((4,), ("tp",)), args=batch, annotations=GPT_VOCAB, dynamic=False)
    assert plan.module(3).get_parameter("wte.weight").shape[0] == 0
    plan.check(*batch)


# ------------------------------------------------------------------ uneven data parallel
DP_MESHES = [((4,), ("dp",)), ((3, 2), ("tp", "dp")), ((2, 3), ("dp", "tp"))]


def _mse_grads_match_serial(plan, model, x, y):
    """A loss taken outside the module (mse over each rank's output rows), summed gradients."""
    from autopar.runtime.simulator import run_ranks

    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), y).backward()
    mods = [plan.module(r) for r in plan.mesh.ranks()]
    ins = [
        (plan.local_inputs(r, x)[0][0], shard_tensor(y, plan.output_specs[0], plan.mesh, r)) for r in plan.mesh.ranks()
    ]

    def step(r):
        xl, yl = ins[r]
        F.mse_loss(mods[r](xl), yl).backward()
        return {n: p.grad.clone() for n, p in mods[r].named_parameters()}

    merged = plan.merge_state_dicts(run_ranks(plan.mesh.size, step))
    for n, p in ref.named_parameters():
        torch.testing.assert_close(merged[n], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("mesh", DP_MESHES, ids=["dp4", "tp3xdp2", "dp2xtp3"])
def test_uneven_batch_weighs_each_rank_by_its_rows(mesh):
    """A batch of 6 (5 on dp=2) cut 2,2,1,1 (3,2): the plan takes any batch size afterwards, a mean
    over the batch inside the model and a loss over the outputs outside it are the serial means."""
    torch.manual_seed(0)
    model = MLP(d=16, hidden=66)
    batch = 6 if mesh[0][mesh[1].index("dp")] == 4 else 5
    x, y = torch.randn(batch, 16), torch.randn(batch, 16)
    ann = MLP_TP if "tp" in mesh[1] else {}
    plan = ap.plan(model, ap.Mesh(*mesh), args=(x,), annotations=ann, data_parallel="dp")
    assert plan.ragged
    dp = plan.mesh.axis_names.index("dp")
    rows = {plan.local_inputs(r, x)[0][0].shape[0] for r in plan.mesh.ranks()}
    assert rows == set(piece_sizes(batch, plan.mesh.shape[dp]))
    plan.check(x)
    plan.check(torch.randn(7, 16))  # any batch afterwards
    _mse_grads_match_serial(plan, model, x, y)


class MeanLoss(nn.Module):
    """A model whose loss is a mean over the batch inside it (Partial("avg") weighed by rows)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(d=16, hidden=32, layers=1)

    def forward(self, x, y):
        return ((self.mlp(x) - y) ** 2).mean()


@pytest.mark.parametrize("dynamic", [True, False])
def test_mean_over_an_uneven_batch_is_the_serial_mean(dynamic):
    torch.manual_seed(0)
    model, x, y = MeanLoss(), torch.randn(6, 16), torch.randn(6, 16)
    plan = ap.plan(model, ap.Mesh((4,), ("dp",)), args=(x, y), data_parallel="dp", dynamic=dynamic)
    assert plan.check(x, y)["grads"] == 6


@pytest.mark.parametrize("mesh", [((4,), ("dp",)), ((2, 3), ("dp", "tp"))], ids=["dp4", "dp2xtp3"])
def test_token_weighted_loss_with_ignore_index_on_uneven_batches(mesh):
    """Cross-entropy with ignore_index over a batch of 5 cut unevenly: ranks hold different numbers
    of real tokens, and the loss is still the serial mean over all of them."""
    model = uneven_gpt(67)
    idx, tg = uneven_batch(67, batch=5)
    tg[0, :5] = -100
    tg[4, 2:] = -100  # the last rank's rows are mostly ignored
    ann = MEGATRON | GPT_VOCAB if "tp" in mesh[1] else {}
    plan = ap.plan(model, ap.Mesh(*mesh), args=(idx, tg), annotations=ann, data_parallel="dp")
    assert plan.ragged
    assert plan.check(idx, tg)["grads"] == len(list(model.parameters()))


# ------------------------------------------------------- preset, explain, cost model
def test_megatron_preset_splits_odd_vocabularies_and_says_so():
    """A vocabulary of 130 on tp=4 (the preset chose vocab-parallel and the plan then failed)."""
    model, batch = uneven_gpt(130), uneven_batch(130)
    ann = ap.presets.megatron(model, "tp", args=batch, size=4)
    assert "wte: vocab_parallel('tp')" in ann.explain() and "130 on tp=4 are pieces 33, 33, 32, 32" in ann.explain()
    plan = ap.plan(model, ap.Mesh((4,), ("tp",)), args=batch, annotations=ann)
    plan.check(*batch)


def test_explain_and_cost_count_uneven_pieces():
    torch.manual_seed(0)
    plan = ap.plan(MLP(d=16, hidden=66), ap.Mesh((4,), ("tp",)), args=(torch.randn(6, 16),), annotations=MLP_TP)
    text = plan.explain("layers.0.fc1.weight")
    assert "local shapes (17, 16) (16, 16)" in text and "66 rows on tp=4: pieces 17, 17, 16, 16" in text
    # the cost model counts the largest piece: per layer fc1 (17 x 16 + 17) and fc2 (16 x 17 + 16),
    # two layers, and the norm (32), in fp32
    assert plan.cost().at()["memory"]["params"] == 4 * (2 * (17 * 16 + 17 + 16 * 17 + 16) + 32)
    even = ap.plan(MLP(d=16, hidden=68), plan.mesh, args=(torch.randn(6, 16),), annotations=MLP_TP)
    assert plan.cost().at()["flops"] == pytest.approx(even.cost().at()["flops"], rel=0.02)  # 17 rows, as 68/4


# ----------------------------------------------------------- zero 0-3 with uneven pieces
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("mesh", [((4,), ("dp",)), ((2, 3), ("dp", "tp"))], ids=["dp4", "dp2xtp3"])
def test_zero_levels_train_like_serial_on_uneven_pieces(zero, mesh):
    """AdamW steps with ZeRO 0-3 on an uneven batch (5 rows: 2,1,1,1 on dp=4, 3,2 on dp=2) and a
    hidden size of 64 on tp=3 (22, 21, 21; zero=3 buckets them at each tp rank's own sizes): parameters after 3
    steps equal serial."""
    from autopar.runtime.simulator import run_ranks
    from tests.harness.data_parallel import loss_of, make_optimizer

    torch.manual_seed(0)
    model = MLP(d=16, hidden=64)
    data = [torch.randn(5, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    ann = MLP_TP if "tp" in mesh[1] else {}
    dp = ap.DataParallel("dp", zero=zero, bucket_max_params=3)
    plan = ap.plan(model, ap.Mesh(*mesh), args=(data[0],), annotations=ann, data_parallel=dp)
    if zero == 3:  # every weight sharded over dp, the uneven tp pieces too (at their own sizes)
        from autopar.parallel.data_parallel.fsdp_layout import bucket_index, rank_buckets

        assert {n for n, _ in model.named_parameters()} == set(bucket_index(plan))
        sizes = {b.numel for r in plan.mesh.ranks() for b in rank_buckets(plan, r)}
        assert len(sizes) > (1 if "tp" in mesh[1] else 0)

    def train(rank):
        module = plan.build_module(rank)
        opt = make_optimizer(module, "adamw", zero)
        for x in data:
            (a,), _ = plan.local_inputs(rank, x)
            loss_of(module(a)).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    merged = plan.merge_state_dicts(run_ranks(plan.mesh.size, train))
    serial = copy.deepcopy(model)
    opt = torch.optim.AdamW(serial.parameters(), lr=0.01, weight_decay=0.1)
    for x in data:
        loss_of(serial(x)).backward()
        opt.step()
        opt.zero_grad()
    for n, p in serial.named_parameters():
        torch.testing.assert_close(merged[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


# ------------------------------------------------------------------ randomness on uneven pieces
class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 66), nn.Linear(66, 16), nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(F.relu(self.fc1(x)))
        return self.fc2(h + torch.rand_like(h) * 0.1)


@pytest.mark.parametrize("shape", [(4,), (3,)], ids=["4", "3"])
def test_serial_randomness_on_uneven_pieces(shape):
    """rng='serial': dropout and rand_like on a hidden size of 66 cut 17,17,16,16 draw the serial
    model's numbers (each rank's piece of the whole draw at its tensor_split offset)."""
    torch.manual_seed(0)
    model, x = DropoutMLP(), torch.randn(6, 16)
    ann = {"fc1": ap.colwise("tp"), "fc2": ap.rowwise("tp")}
    plan = ap.plan(model, ap.Mesh(shape, ("tp",)), args=(x,), annotations=ann, rng="serial")
    assert plan.check(x)["grads"] == 4


# ------------------------------------------------------------------ pipelines
@pytest.mark.parametrize(
    "mesh,schedule", [(((2, 3), ("pp", "tp")), "1f1b"), (((2, 2), ("pp", "tp")), "gpipe")], ids=["pp2xtp3", "pp2xtp2"]
)
def test_pipeline_stages_with_uneven_tp_pieces(mesh, schedule):
    """Vocabulary 67 and sequence 7 in a 4-block GPT, 2 stages, tp=3 or 2 inside each: every
    gradient and the loss equal serial, and every parameter has a home."""
    from autopar.runtime.simulator import run_ranks
    from tests.harness.serial import covered, grad_errors, serial_step

    model, batch = uneven_gpt(67, layers=4), uneven_batch(67, batch=8, seq=7)
    serial_loss, serial_grads = serial_step(model, batch)
    pipeline = ap.Pipeline("pp", microbatches=4, schedule=schedule)
    plan = ap.plan(model, ap.Mesh(*mesh), args=batch, annotations=MEGATRON | GPT_VOCAB, pipeline=pipeline)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    losses = run_ranks(plan.mesh.size, lambda r: runners[r].step(batch, None), timeout=60)
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    assert not [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]
    assert not covered([r.params for r in runners], model)


@pytest.mark.parametrize(
    "mesh,batch", [(((2,), ("pp",)), 6), (((2, 2), ("pp", "dp")), 12)], ids=["pp2-batch6", "pp2xdp2-batch12"]
)
def test_micro_batches_that_do_not_divide_the_batch(mesh, batch):
    """6 rows per rank in 4 micro-batches (2, 2, 1, 1): each micro-batch's loss weighted by its
    share of the rows, so the step's loss and every gradient are the serial ones over the whole
    batch (not the mean of the micro-batches' means)."""
    from autopar.runtime.simulator import run_ranks
    from tests.harness.serial import grad_errors, serial_step

    model, data = uneven_gpt(67, layers=2), uneven_batch(67, batch=batch, seq=5)
    serial_loss, serial_grads = serial_step(model, data)
    dp = "dp" if "dp" in mesh[1] else None
    plan = ap.plan(model, ap.Mesh(*mesh), args=data, pipeline=ap.Pipeline("pp", microbatches=4), data_parallel=dp)
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    losses = run_ranks(plan.mesh.size, lambda r: runners[r].step(data, None), timeout=60)
    assert runners[0]._weights == [2 / 6, 2 / 6, 1 / 6, 1 / 6]
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    assert not [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]


def test_fewer_rows_than_micro_batches_is_refused():
    model, data = uneven_gpt(67, layers=2), uneven_batch(67, batch=3, seq=5)
    plan = ap.plan(model, ap.Mesh((2,), ("pp",)), args=data, pipeline=ap.Pipeline("pp", microbatches=4))
    with pytest.raises(ap.InputError, match="at least 4 rows"):
        plan.pipeline_runner(0).step(data, None)


# ------------------------------------------- every rule of the rule harness on uneven pieces
RULE_CASES = __import__("tests.simulated.test_rules", fromlist=["CASES"]).CASES
# the cases whose placed dim is smaller than 8: on 8 ranks some hold an empty piece
EMPTY = [n for n, (_, shape, pl, *_) in sorted(RULE_CASES.items()) if shape[pl[0][0].dim] < 8]


@pytest.mark.parametrize(
    "name,ranks", [(n, 3) for n in sorted(RULE_CASES)] + [(n, 8) for n in EMPTY], ids=lambda v: str(v)
)
def test_rule_harness_on_uneven_and_empty_pieces(name, ranks):
    """tests/simulated/test_rules.py's cases (shapes of 4 and 8 rows) split on 3 ranks (2,1,1 and
    3,3,2 rows) as on 2, and on 8 ranks where the dim is smaller (4 rows: 1,1,1,1,0,0,0,0), every
    dim static: serial forward and every gradient."""
    fn, shape, placements, *extra = RULE_CASES[name]
    torch.manual_seed(0)
    model, x = OpModule(fn, shape, extra[0] if extra else ()), torch.randn(shape)
    ann = {"x": ap.place(*placements[0])}
    plan = ap.plan(model, ap.Mesh((ranks,), ("a",)), args=(x,), annotations=ann, strict=True, dynamic=False)
    plan.check(x)


def test_hf_gpt2_with_its_real_vocabulary_on_tp4():
    """HF GPT-2 (vocabulary 50257, hidden 24) with the Megatron preset on tp=4: 12565, 12564,
    12564, 12564 rows of the embedding and the head, equal to serial."""
    import transformers  # pinned in requirements-test.txt: a missing install should fail, not skip

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=50257, n_positions=16, n_embd=24, n_layer=1, n_head=2, attn_implementation="eager", use_cache=False
    )
    model, ids = transformers.GPT2LMHeadModel(cfg).eval(), torch.randint(0, 50257, (2, 6))
    kwargs = {"input_ids": ids, "labels": ids}
    ann = ap.presets.megatron(model, "tp", kwargs=kwargs, size=4)
    assert "50257 on tp=4 are pieces 12565, 12564, 12564, 12564" in ann.explain()
    plan = ap.plan(model, ap.Mesh((4,), ("tp",)), kwargs=kwargs, annotations=ann)
    plan.check(**kwargs)


def test_ragged_batch_gathered_with_its_sizes_exchanged():
    """A batch of 5 placed split on a tensor-parallel axis, outputs gathered there: each rank's
    run-time size is exchanged first, the pieces padded to the largest, gathered and trimmed
    (runtime/uneven.ragged_all_gather); any batch runs (5, then 7), equal to serial."""
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    plan = ap.plan(MLP(), ap.Mesh((2,), ("tp",)), args=(x,), annotations={"x": ap.place(S(0))})
    assert plan.ragged and "ragged_all_gather" in plan.module(0).code
    plan.check(x)
    plan.check(torch.randn(7, 16))


class AddInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, y):
        return self.fc(x + y)


def test_ragged_batch_that_must_be_sliced_is_refused_while_planning():
    """x's batch of 5 placed split on tp, y's whole: y would be cut to x's pieces, whose run-time
    sizes no rank knows, so the plan is refused naming the input and the fix."""
    x, y = torch.randn(5, 16), torch.randn(5, 16)
    with pytest.raises(ap.ShardingError, match=r"input 'y' .* moved across mesh axis 'tp' \(slice\).*divides by 2"):
        ap.plan(AddInputs(), ap.Mesh((2,), ("tp",)), args=(x, y), annotations={"x": ap.place(S(0))})
    ok = ap.plan(AddInputs(), ap.Mesh((2,), ("tp",)), args=(x, y), annotations={"x": ap.place(S(0))}, dynamic=False)
    ok.check(x, y)  # the same batch as a static size: padded and sliced


def test_compiled_rank_modules_on_an_uneven_batch():
    """torch.compile of a ragged plan's modules (a batch of 3 on dp=2): the rows are counted
    eagerly (runtime/uneven.ragged_share is not traced) and the gradients equal serial."""
    from autopar.runtime.simulator import run_ranks

    torch.manual_seed(0)
    model, x, y = MeanLoss(), torch.randn(3, 16), torch.randn(3, 16)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(x, y), data_parallel="dp")
    ref = copy.deepcopy(model)
    ref(x, y).backward()

    def grads(r):
        a, k = plan.local_inputs(r, x, y)
        m = plan.build_module(r)
        torch.compile(m, backend="aot_eager")(*a, **k).backward()  # the capture; inductor adds nothing here
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    merged = plan.merge_state_dicts(run_ranks(2, grads, timeout=300))
    for n, p in ref.named_parameters():
        torch.testing.assert_close(merged[n], p.grad, rtol=1e-5, atol=1e-6)


class BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x)))).pow(2).mean()


@pytest.mark.parametrize("dynamic", [True, False], ids=["ragged", "static"])
def test_synced_batch_norm_over_an_uneven_batch(dynamic):
    """A batch of 6 on dp=4 (2, 2, 1, 1 rows) through a synced BatchNorm: the per-channel sums and
    counts are summed over the pieces, so statistics, output and every gradient equal serial."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    model = ap.sync_batch_norm(BatchNormMLP())
    plan = ap.plan(model, ap.Mesh((4,), ("dp",)), args=(x,), data_parallel="dp", dynamic=dynamic)
    assert bool(plan.ragged) == dynamic
    assert plan.check(x)["grads"] == 6
