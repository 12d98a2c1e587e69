"""Issue 32's user paths (simulated): what a training loop does after set-up and across ranks
that must not drift apart. Freezing a parameter after planning, batch-norm buffers under data
parallelism, the loss contract with per-rank sequence lengths."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks
from tests.harness import data_parallel as H

ZEROS = [0, 1, 2, 3]


# ------------------------------------------------------------ freezing after planning
def _frozen_after_planning(mesh_name, zero, freeze="layers.0.fc1.weight", steps=2):
    """Plan, then freeze ``freeze`` on every rank's module (as fine-tuning code does after
    set-up); AdamW with weight decay. Each rank's (grad is None, params after steps)."""
    plan = H.make_plan(mesh_name).with_data_parallel(ap.DataParallel("dp", zero=zero, bucket_max_params=3))

    def step(rank):
        module = plan.build_module(rank)
        module.get_parameter(freeze).requires_grad_(False)
        cls, kw = torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = ap.ZeroOptimizer(module, cls, **kw) if zero in (1, 2) else cls(params, **kw)
        no_grad = True
        for x in H.batches(steps):
            H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
            no_grad = no_grad and module.get_parameter(freeze).grad is None
            opt.step()
            opt.zero_grad()
        return no_grad, {n: p.detach().clone() for n, p in module.named_parameters()}

    results = run_ranks(plan.mesh.size, step)
    return plan, [r[0] for r in results], plan.merge_state_dicts([r[1] for r in results])


@pytest.mark.parametrize("mesh_name", ["dp2", "dp2xtp2"])
@pytest.mark.parametrize("zero", ZEROS)
def test_parameter_frozen_after_planning_is_not_moved(mesh_name, zero):
    """The frozen weight keeps ``grad is None`` on every rank and does not move (AdamW's weight
    decay moved it by 0.0025 before); the others train as the serial model with it frozen."""
    name = "layers.0.fc1.weight"
    plan, no_grads, merged = _frozen_after_planning(mesh_name, zero, name)
    assert all(no_grads), no_grads
    serial = H.make_model()
    before = serial.get_parameter(name).detach().clone()
    serial.get_parameter(name).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in serial.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    for x in H.batches(2):
        H.loss_of(serial(x)).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(merged[name], before)
    for n, p in serial.named_parameters():
        torch.testing.assert_close(merged[n], p.detach(), rtol=1e-4, atol=1e-5, msg=n)


# ------------------------------------------------------------ batch norm under data parallel
class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _bn_batches(n=3, b=8):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(b, 3, 6, 6, generator=g) * (1 + i) for i in range(n)]


def _bn_ranks(mesh, dp):
    """Train on every rank (SGD, 3 steps), then an eval forward: each rank's buffers and eval output."""
    torch.manual_seed(0)
    model, data = ConvBN(), _bn_batches()
    ann = {"fc": ap.colwise("tp")} if "tp" in mesh.axis_names else {}
    plan = ap.plan(model, mesh, args=(data[0],), annotations=ann, data_parallel=dp)

    def step(rank):
        module = plan.build_module(rank)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for x in data:
            module(*plan.local_inputs(rank, x)[0]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        module.eval()
        with torch.no_grad():
            out = module(*plan.local_inputs(rank, data[0])[0])
        return {n: b.clone() for n, b in module.named_buffers() if n.startswith("bn.")}, out

    return plan, model, data, run_ranks(mesh.size, step)


@pytest.mark.parametrize("shape,axes", [((2,), ("dp",)), ((4,), ("dp",)), ((2, 2), ("dp", "tp"))])
def test_batch_norm_buffers_stay_equal_across_dp_ranks(shape, axes):
    """As DDP (broadcast_buffers=True): the first dp rank's statistics everywhere, so an eval
    forward does not depend on the rank; they are the serial model's fed rank 0's slices."""
    mesh = ap.Mesh(shape, axes)
    plan, model, data, results = _bn_ranks(mesh, "dp")
    group = mesh.group(mesh.axis_index("dp"), 0)
    for r in group[1:]:
        for n, b in results[0][0].items():
            assert torch.equal(b, results[r][0][n]), (r, n)
    ref_buffers, ref_out = _ddp_by_definition(model, data, len(group))
    for r in mesh.ranks():
        for n, b in results[r][0].items():
            torch.testing.assert_close(b, ref_buffers[n], rtol=1e-5, atol=1e-6, msg=n)
    merged = plan.merge_outputs([out for _, out in results])
    torch.testing.assert_close(merged, ref_out, rtol=1e-5, atol=1e-6)


def test_batch_norm_buffers_broadcast_opt_out_keeps_each_ranks_own():
    """broadcast_buffers=False (DDP's opt-out): each dp rank keeps the statistics of its slices."""
    mesh = ap.Mesh((2,), ("dp",))
    _, _, _, results = _bn_ranks(mesh, ap.DataParallel("dp", broadcast_buffers=False))
    assert not torch.equal(results[0][0]["bn.running_mean"], results[1][0]["bn.running_mean"])


def _ddp_by_definition(model, data, dp):
    """DDP with broadcast_buffers=True, written out: dp replicas, each forward on its slice with
    its own batch statistics, gradients averaged, replica 0's buffers copied to all before each
    forward. Replica 0's buffers after training, and the eval output on the whole batch."""
    import copy

    replicas = [copy.deepcopy(model) for _ in range(dp)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in replicas]
    for x in data:
        for m in replicas[1:]:
            m.bn.load_state_dict(replicas[0].bn.state_dict())
        for m, xs in zip(replicas, x.chunk(dp)):
            m(xs).square().mean().backward()
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in replicas)):
                mean = torch.stack([p.grad for p in ps]).mean(0)
                for p in ps:
                    p.grad.copy_(mean)
        for o in opts:
            o.step()
            o.zero_grad()
    ref = replicas[0].eval()
    with torch.no_grad():
        return {f"bn.{n}": b for n, b in ref.bn.named_buffers()}, ref(data[0])


# ------------------------------------------------------------ the loss with per-rank lengths
def _ragged_batches(lengths=(11, 23), b=2):
    """What a dynamic-padding loader gives each dp rank: its own sequence length."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (b, s), generator=g), torch.randint(0, 64, (b, s), generator=g)) for s in lengths]


def _ragged_run(mesh_name, loss_mean):
    from tests.harness.models import GPT, GPT_VOCAB, MEGATRON, GPTConfig
    from tests.harness.meshes import MESHES

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))
    vocab = mesh_name.endswith("+vocab")
    spec, data = MESHES[mesh_name.removesuffix("+vocab")], _ragged_batches()
    plan = ap.plan(
        model,
        spec.mesh(),
        args=data[0],
        annotations=(dict(MEGATRON, **GPT_VOCAB) if vocab else MEGATRON) if "tp" in spec.axes else {},
        data_parallel=ap.DataParallel("dp", loss_mean=loss_mean),
    )
    dp = plan.mesh.axis_index("dp")

    def step(rank):
        module = plan.module(rank)
        _, loss = module(*data[plan.mesh.coords(rank)[dp]])
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in module.named_parameters()}

    results = run_ranks(plan.mesh.size, step)
    return model, data, [r[0] for r in results], plan.merge_state_dicts([r[1] for r in results])


def _serial_union(model, data, per_rank: bool):
    """The serial model on the union of the ranks' batches: the token-weighted mean of the
    per-token losses, or (per_rank) the average of each batch's own mean (DDP's)."""
    model.zero_grad()
    sums = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), t.flatten(), reduction="sum") for x, t in data]
    counts = [t.numel() for _, t in data]
    loss = sum(s / c for s, c in zip(sums, counts)) / len(data) if per_rank else sum(sums) / sum(counts)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh_name", ["dp2", "dp2xtp2", "dp2xtp2+vocab"])
@pytest.mark.parametrize("loss_mean", ["global", "per_rank"])
def test_loss_with_per_rank_sequence_lengths(mesh_name, loss_mean):
    """11 tokens on one dp rank, 23 on the other: by default the loss and every gradient are the
    serial model's on the union of the batches (a token-weighted mean); loss_mean="per_rank"
    gives DDP's (each rank's own mean, averaged)."""
    model, data, losses, grads = _ragged_run(mesh_name, loss_mean)
    ref_loss, ref_grads = _serial_union(model, data, loss_mean == "per_rank")
    for loss in losses:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


# ------------------------------------------------------------ the input guard
def test_input_of_another_dtype_is_an_input_error_naming_it():
    """float64 pixels for a float32 model: an InputError naming the input, not a raw
    "expected scalar type Double" from inside the convolution; under a precision policy any
    floating dtype is fine (the policy casts it)."""
    torch.manual_seed(0)
    x = _bn_batches(1)[0]
    plan = ap.plan(ConvBN(), ap.Mesh((2,), ("dp",)), args=(x,), data_parallel="dp")
    (local,), _ = plan.local_inputs(0, x)
    with pytest.raises(ap.InputError, match=r"input 'x'.*dtype torch.float64.*traced with torch.float32"):
        plan.module(0)(local.double())
    mlp = ap.plan(H.make_model(), ap.Mesh((2,), ("dp",)), args=(H.batches(1)[0],), data_parallel="dp")
    policy = mlp.with_data_parallel(ap.DataParallel("dp", param_dtype=torch.bfloat16))
    outs = policy.simulate(lambda m, a: m(a), H.batches(1)[0].double())
    assert all(o.dtype == torch.bfloat16 for o in outs)


def test_one_tensor_passed_twice_as_example_traces_two_inputs():
    """torch.export makes one placeholder of a tensor object passed twice: ap.plan(args=(x, x))
    traced a model that read its first argument for both (a causal LM trained on targets = ids).
    The trace copies the repeated tensor, so each argument is its own input."""

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, target):
            return (self.lin(x) - target).square().mean()

    torch.manual_seed(0)
    model, t = Regression(), torch.randn(4, 4)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(t, t), data_parallel="dp")
    assert len(plan.traced.user_inputs) == 2
    x, target = torch.randn(4, 4), torch.randn(4, 4)
    plan.check(x, target)
    got = plan.simulate(lambda module, a, b: module(a, b).item(), x, target)
    assert got == pytest.approx([model(x, target).item()] * 2, rel=1e-6)
