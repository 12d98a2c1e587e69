"""Context parallel (ap.ContextParallel): sequences split on a mesh axis, attention by all-gathered
K/V or a ring. Against serial, forward and every gradient, on (2,), (4,) and (2, 2) meshes (with
data parallel, with tensor parallel), on a LLaMA-style model (RoPE from arange, GQA, causal SDPA,
HF's shifted labels). Gloo: tests/gloo/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.errors import PlanError
from autopar.parallel.context.block_attention import block_plan
from autopar.runtime.ring import ring_bytes, ring_steps
from autopar.placement import from_zigzag, local_positions, to_zigzag, zigzag_index
from tests.harness.llama_like import TP, llama_batch, llama_like
from tests.harness.models import MEGATRON, NanoGPTLoss, gpt_batch, small_gpt


def cp_plan(n=2, method="allgather", batch=None, mesh=None, load_balance=False, **kw):
    model = llama_like(**kw.pop("model", {}))
    ids, labels = batch or llama_batch()
    mesh = mesh or ap.Mesh((n,), ("cp",))
    cp = ap.ContextParallel("cp", method=method, load_balance=load_balance)
    plan = ap.plan(model, mesh, args=(ids, labels), context_parallel=cp, **kw)
    return plan, (ids, labels)


def _attention_nodes(plan):
    return [n for n in plan.graph.nodes if "scaled_dot_product_attention" in str(n.target)]


@pytest.mark.parametrize("method", ["allgather", "ring"])
@pytest.mark.parametrize("n", [2, 4])
def test_llama_like_matches_serial(method, n):
    plan, batch = cp_plan(n, method)
    got = plan.check(*batch, loss=lambda out: out[1])
    assert got["grads"] == len(list(plan.model.parameters()))
    ids = plan.local_inputs(1, *batch)[0][0]
    assert ids.shape == (2, 16 // n) and torch.equal(ids, batch[0][:, 16 // n : 2 * 16 // n])
    assert len(plan.built["context_parallel"]) == 2  # both attention calls lowered
    for node in _attention_nodes(plan):
        assert "context_parallel_attention" in node.meta["autopar"].reason


@pytest.mark.parametrize("method", ["allgather", "ring"])
@pytest.mark.parametrize(
    "model",
    [
        dict(causal=False),  # no mask: every key
        dict(built_mask=True),  # the causal mask built by the model, given to SDPA
        dict(kv_heads=1, learned_positions=True),  # multi-query attention, learned positions
        dict(kv_heads=4),  # plain multi-head attention
    ],
)
def test_attention_forms_match_serial(method, model):
    plan, batch = cp_plan(4, method, model=model)
    plan.check(*batch, loss=lambda out: out[1])


@pytest.mark.parametrize("method", ["allgather", "ring"])
@pytest.mark.parametrize("n", [2, 4])
def test_load_balanced_matches_serial(method, n):
    """The zig-zag order: rank r holds chunks r and 2n-1-r of the sequence; RoPE's positions (from
    arange) and the causal mask follow, and the labels' shift is taken in serial order."""
    plan, batch = cp_plan(n, method, load_balance=True, batch=llama_batch(batch=4))
    plan.check(*batch, loss=lambda out: out[1])
    c = 16 // (2 * n)
    ids = plan.local_inputs(0, *batch)[0][0]
    assert torch.equal(ids, torch.cat([batch[0][:, :c], batch[0][:, 16 - c :]], dim=1))
    learned = cp_plan(n, method, load_balance=True, model=dict(learned_positions=True, built_mask=True))[0]
    learned.check(*llama_batch(), loss=lambda out: out[1])


@pytest.mark.parametrize("method, balanced", [("allgather", False), ("ring", True)])
def test_local_inputs_are_contiguous_for_a_view_loss(method, balanced):
    """nanoGPT's loss calls ``targets.view(-1)``: each rank's sequence piece (plain or zig-zag) is a
    contiguous tensor of its own, as a DTensor's local tensor is, in check, simulate and local_inputs."""
    idx, tg = gpt_batch(batch=2, seq=16)
    cp = ap.ContextParallel("cp", method=method, load_balance=balanced)
    plan = ap.plan(NanoGPTLoss(), ap.Mesh((4,), ("cp",)), args=(idx, tg), context_parallel=cp)
    for r in plan.mesh.ranks():
        assert all(t.is_contiguous() for t in plan.local_inputs(r, idx, tg)[0])
    plan.check(idx, tg, loss=lambda out: out)
    losses = plan.simulate(lambda m, *a: m(*a).item(), idx, tg)
    assert max(abs(x - NanoGPTLoss()(idx, tg).item()) for x in losses) < 1e-5


@pytest.mark.parametrize("method, balanced", [("allgather", False), ("ring", True), ("ring", False)])
def test_float64_model_keeps_its_precision(method, balanced):
    """A float64 GPT on cp=2 (dp=2 beside it: its cross-entropy over split rows): forward and backward
    in float64 throughout (the block attention's log-sum-exp was float32 and the backward failed),
    the loss exact to 1e-12 and every gradient at float64 tolerances."""
    model = NanoGPTLoss().double()
    idx, tg = gpt_batch(batch=4, seq=16)
    cp = ap.ContextParallel("cp", method=method, load_balance=balanced)
    plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "cp")), args=(idx, tg), data_parallel="dp", context_parallel=cp)
    report = plan.check(idx, tg, loss=lambda out: out)
    assert report["rtol"] == 1e-9 and report["max_rel"] < 1e-12
    want = model(idx, tg).item()
    losses = plan.simulate(lambda m, *a: m(*a), idx, tg)
    assert all(x.dtype == torch.float64 and abs(x.item() - want) < 1e-12 * abs(want) for x in losses)


def test_zigzag_evens_causal_work():
    """The blocks each rank computes under the causal mask: exactly the (query, key) pairs the
    serial mask keeps, with no mask tensor (the diagonal block is a lower triangle, the others
    whole parts); their work is equal on every rank with the zig-zag order (half of each other
    block), (2r + 1) x half a block with contiguous pieces."""
    n, L = 4, 8  # local rows per rank
    for zigzag, expect_equal in ((True, True), (False, False)):
        work = []
        for pos in range(n):
            total = 0
            for src in range(n):
                b = block_plan(None, True, n, pos, src, L, L, zigzag)
                got = torch.zeros(L, L, dtype=torch.bool)
                if b is not None:
                    assert b.mask is None
                    part = torch.ones(b.qn, b.kn, dtype=torch.bool)
                    got[b.q0 : b.q0 + b.qn, b.k0 : b.k0 + b.kn] = part.tril() if b.causal else part
                    total += int(got.sum())
                qpos, kpos = local_positions(L, n, pos, zigzag), local_positions(L, n, src, zigzag)
                assert torch.equal(got, kpos[None, :] <= qpos[:, None]), (zigzag, pos, src)
            work.append(total)
        assert (len(set(work)) == 1) == expect_equal, work
    assert zigzag_index(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    x = torch.arange(24).view(2, 12)
    assert torch.equal(from_zigzag(to_zigzag(x, 1, 3), 1, 3), x)
    assert torch.equal(from_zigzag(to_zigzag(x.flatten(), 0, 3, blocks=2), 0, 3, blocks=2), x.flatten())


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_with_data_parallel_and_zero3(method):
    mesh = ap.Mesh((2, 2), ("dp", "cp"))
    plan, batch = cp_plan(method=method, mesh=mesh, batch=llama_batch(batch=4), data_parallel="dp")
    plan.check(*batch, loss=lambda out: out[1])
    z3 = plan.with_options(plan.options.replace(data_parallel=ap.DataParallel("dp", zero=3)))
    z3.check(*batch, loss=lambda out: out[1])


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_with_tensor_parallel(method):
    mesh = ap.Mesh((2, 2), ("tp", "cp"))
    plan, batch = cp_plan(method=method, mesh=mesh, annotations=TP)
    plan.check(*batch, loss=lambda out: out[1])
    q = _attention_nodes(plan)[0].meta["autopar"].input_targets[0]
    assert q == (ap.Shard(1), ap.Shard(2))  # heads on tp, positions on cp


@pytest.mark.parametrize("method, balanced", [("ring", False), ("allgather", True)])
def test_eager_gpt_with_megatron_and_checkpointing(method, balanced):
    """The package's GPT computes attention eagerly (matmul, scale, masked_fill, softmax, matmul):
    rewritten into SDPA before planning, on tp x cp with Megatron on tp, checkpointed."""
    idx, tg = gpt_batch(batch=4, seq=16)
    cp = ap.ContextParallel("cp", method=method, load_balance=balanced)
    ac = ap.ActivationCheckpoint("full" if balanced else "selective")
    mesh = ap.Mesh((2, 2), ("tp", "cp"))
    plan = ap.plan(
        small_gpt(), mesh, args=(idx, tg), annotations=MEGATRON, context_parallel=cp, activation_checkpoint=ac
    )
    assert len(plan.built["context_parallel"]) == 2
    plan.check(idx, tg, loss=lambda out: out[1])


def test_ring_collectives_and_costs():
    ring, _ = cp_plan(4, "ring")
    gather, _ = cp_plan(4, "allgather")
    kv = 2 * 2 * 4 * 8 * 4  # K (B 2, Hkv 2, L/4 4, E 8) float32
    ring_comms = [c for c in ring.collectives() if c.kind in ("ring_pass", "ring_shift")]
    assert {c.phase for c in ring_comms} == {"forward", "backward"}
    per_call_fwd = sum(c.bytes for c in ring_comms if c.phase == "forward") / 2  # 2 attention calls
    assert per_call_fwd == pytest.approx(2 * 3 * kv)  # K and V, n - 1 = 3 shifts each
    assert ring_steps("ring_pass", 4) == 3 and ring_bytes("ring_pass", kv, 4) == 3 * kv
    gathers = [c for c in gather.collectives() if c.kind == "all_gather" and "attn" in c.module]
    assert sum(c.bytes for c in gathers) == pytest.approx(2 * 2 * 3 * kv)  # 2 calls x K, V x (n-1) kv
    with ap.comm_stats() as stats:
        ring.simulate(lambda m, ids, labels: m(ids, labels)[1].backward(), *llama_batch())
    shifts = [r for r in stats.records if r.kind == "ring_shift"]
    # per call: forward 2 x 3, backward 2 x 3 (K, V) + 2 x 4 (their gradients)
    assert len(shifts) == 2 * (6 + 6 + 8)
    assert sum(r.bytes for r in shifts) == pytest.approx(sum(c.bytes for c in ring_comms))  # the plan's bytes ran


def test_memory_model_counts_gathered_kv_workspace_and_steps():
    """The cost model's terms for the lowered attention: all-gather keeps each call's gathered K
    and V (cp x the rank's piece) where the ring keeps its own piece; both hold a workspace while
    a call runs (the ring's blocks, all-gather's gathered fp32 gradients: more); the ring's steps
    as compute and shift terms of one step. bench/bench_context_parallel.py and
    tests/gloo/test_context_parallel.py hold them against what LiveBytes measures."""
    ring, _ = cp_plan(4, "ring")
    gather, _ = cp_plan(4, "allgather")
    kv = 2 * 2 * 4 * 8 * 4  # the rank's K (B 2, Hkv 2, L/4 4, E 8) float32
    r, g = ring.memory_per_rank(0), gather.memory_per_rank(0)
    assert g["activations"] - r["activations"] == 2 * 2 * 3 * kv  # 2 calls x K, V x (n - 1) pieces more
    assert 0 < r["workspace"] < g["workspace"]
    cost = gather.cost()
    cp = cost.symbols["cp"]
    assert cp in cost.memory["activations"].free_symbols and cp in cost.memory["workspace"].free_symbols
    assert cost.at()["memory"]["activations"] == pytest.approx(g["activations"])
    steps = ring.cost().steps(alpha=1e-5, beta=1e9, flops_per_s=1e12)
    assert len(steps) == 2
    for one in steps.values():
        assert ring.cost().sy.value(one["steps"]) == 4
        # forward K, V (kv each) and backward K, V and their fp32 gradients: 6 kv, 6 messages
        assert ring.cost().sy.value(one["shift"]) == pytest.approx(6 * 1e-5 + 6 * kv / 1e9)
        assert ring.cost().sy.value(one["compute"]) == pytest.approx(3 * 4 * (2 * 4 * 4 * 8) * 4 / 1e12)
    assert not gather.cost().steps() or all(
        gather.cost().sy.value(v["shift"]) == 0 for v in gather.cost().steps().values()
    )


@pytest.mark.parametrize("method", ["allgather", "ring"])
@pytest.mark.parametrize("mesh", [((4,), ("cp",)), ((2, 2), ("dp", "cp"))])
def test_serial_dropout_under_load_balance(method, mesh):
    """Dropout outside attention (on the embeddings and each MLP's output) with rng="serial"
    under the zig-zag order: each rank draws the serial mask and keeps its chunks r and 2n-1-r
    (runtime/rng._piece), so outputs and every gradient equal serial's."""
    dp = "dp" if "dp" in mesh[1] else None
    plan, batch = cp_plan(
        method=method, mesh=ap.Mesh(*mesh), load_balance=True, batch=llama_batch(batch=4), data_parallel=dp,
        model=dict(dropout=0.3), rng="serial",
    )  # fmt: skip
    drops = [n for n in plan.graph.nodes if "dropout" in str(n.target)]
    assert len(drops) == 3 and all(n.meta["autopar"].spec[-1] == ap.Shard(1) for n in drops)
    plan.check(*batch, loss=lambda out: out[1])


@pytest.mark.parametrize("method", ["allgather", "ring", "ulysses"])
def test_with_pipeline(method):
    """pp x cp: pipeline stages on one axis, the sequence split on the other (load balanced);
    each stage runs its micro-batches on the rank's sequence pieces. Loss and every gradient
    equal the serial step's. A micro-batch whose regrouped labels (HF's shift moves them along
    the batch) do not cut into 2 x cp chunks is a PlanError at planning, not a failure at run time."""
    from autopar.runtime.simulator import run_ranks
    from tests.harness.serial import grad_errors, serial_step

    model, batch = llama_like(), llama_batch(batch=8)
    cp = ap.ContextParallel("cp", method=method, load_balance=True)
    with pytest.raises(PlanError, match="micro-batch"):
        ap.plan(
            model, ap.Mesh((2, 2), ("pp", "cp")), args=llama_batch(batch=4), context_parallel=cp,
            pipeline=ap.Pipeline("pp", microbatches=2),
        )  # fmt: skip
    plan = ap.plan(
        model, ap.Mesh((2, 2), ("pp", "cp")), args=batch, context_parallel=cp,
        pipeline=ap.Pipeline("pp", microbatches=2),
    )  # fmt: skip
    runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    losses = run_ranks(plan.mesh.size, lambda r: runners[r].step(batch), timeout=60)
    serial_loss, serial_grads = serial_step(model, batch)
    for loss in losses:
        torch.testing.assert_close(loss, serial_loss, rtol=1e-5, atol=1e-6)
    errors = [e for r in plan.mesh.ranks() for e in grad_errors(plan, r, runners[r], serial_grads)]
    assert not errors, errors[:5]


def test_bad_input_is_a_plan_error():
    with pytest.raises(PlanError, match="does not split into 4"):
        cp_plan(4, batch=llama_batch(seq=10))
    with pytest.raises(PlanError, match="both on axis"):
        ap.plan(llama_like(), ap.Mesh((2,), ("cp",)), args=llama_batch(), data_parallel="cp", context_parallel="cp")
    with pytest.raises(PlanError, match="does not split into 8 equal pieces"):
        cp_plan(4, batch=llama_batch(seq=12), load_balance=True)  # 2 chunks per rank
    with pytest.raises(PlanError, match="method"):
        ap.ContextParallel("cp", method="tree")
    for seq_dim in (0, 1.0, True):  # the batch dim, a float, a bool: refused when made (was never checked)
        with pytest.raises(PlanError, match="seq_dim"):
            ap.ContextParallel("cp", seq_dim=seq_dim)
    with pytest.raises(PlanError, match="KV cache"):
        ap.plan(CachedLM(), ap.Mesh((2,), ("cp",)), args=llama_batch(), context_parallel="cp")


class CachedLM(torch.nn.Module):
    """Returns its keys as a cache (HF's legacy past_key_values form)."""

    def __init__(self):
        super().__init__()
        self.lm = llama_like(layers=1)

    def forward(self, ids, labels):
        logits, loss = self.lm(ids, labels)
        return {"loss": loss, "past_key_values": [self.lm.embed(ids)]}
