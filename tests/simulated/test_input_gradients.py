"""The contracts the OpInfo run found broken (issue 31), each against serial on several meshes:

- the gradient of a user input that requires grad is whole on every rank where the input is
  replicated and its slice where it is split (an ``inputs_embeds``, a soft prompt, a weight
  passed as an input), and an input planned without requires_grad that requires it at run
  time is refused;
- ``plan.check`` compares every rank's outputs and every input's gradient;
- cross-entropy with class probabilities (soft labels) over split rows is the serial mean;
- a lowering that needs a dynamic dim of an input (embedding / vocab-parallel cross-entropy with
  the weight passed as an input) runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.runtime import serial_check
from tests.harness.meshes import MeshSpec

R, S = ap.Replicate(), ap.Shard
MESHES = (
    MeshSpec((2,), ("a",)),
    MeshSpec((3,), ("a",)),
    MeshSpec((4,), ("a",)),
    MeshSpec((2, 2), ("a", "b")),
    MeshSpec((2, 1, 2), ("a", "b", "c")),
)


def _first_axis(mesh: ap.Mesh, p):
    return ap.place(*([p] + [R] * (mesh.ndim - 1)))


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, *tensors):
        return self.fn(x, *tensors)


# (fn, x shape, other inputs' shapes): every other input requires grad and stays replicated
BROADCASTS = {
    "add": (lambda x, y: x + y, (6, 4), [(4,)]),
    "mul": (lambda x, y: x * y, (6, 4), [(6, 4)]),
    "where": (lambda x, y: torch.where(x > 0, x, y), (6, 4), [(1, 4)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), (6, 4), [(5, 4), (5,)]),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b), (6, 3, 8), [(4, 3, 3), (4,)]),
    "baddbmm": (lambda x, b1, b2: torch.baddbmm(x, b1, b2), (6, 2, 4), [(6, 2, 3), (6, 3, 4)]),
}


@pytest.mark.parametrize("name", list(BROADCASTS))
def test_replicated_input_gradient_is_whole_on_every_rank(name):
    fn, shape, others = BROADCASTS[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    tensors = [torch.randn(s, generator=gen).requires_grad_() for s in others]
    for spec in MESHES:
        mesh = spec.mesh()
        if shape[0] % mesh.shape[0]:
            continue
        plan = ap.plan(Fn(fn), mesh, args=(x, *tensors), annotations={"x": _first_axis(mesh, S(0))})
        report = plan.check(x, *tensors)
        assert report["input_grads"] == len(tensors), report


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_batch_split_input_gathered_for_a_broadcast_gets_its_gradient_slice(mesh_shape):
    """data_parallel splits every input's dim 0; ``y`` (6,) must be gathered to broadcast over
    ``x``'s rows, and its gradient, in parts over the ranks, reduce-scattered back."""
    mesh = ap.Mesh(mesh_shape, ("dp", "tp")[: len(mesh_shape)])
    model = Fn(lambda x, y: x * y)
    x, y = torch.randn(4, 12), torch.randn(12, requires_grad=True)
    plan = ap.plan(model, mesh, args=(x, y), data_parallel="dp")
    assert plan.check(x, y)["input_grads"] == 1


def test_input_that_requires_grad_only_at_run_time_is_refused():
    mesh = ap.Mesh((2,), ("a",))
    x, y = torch.randn(6, 4), torch.randn(4)
    plan = ap.plan(Fn(lambda x, y: x + y), mesh, args=(x, y), annotations={"x": ap.place(S(0))})
    (a, b), _ = plan.local_inputs(0, x, y)
    with pytest.raises(
        ap.InputError, match=r"'tensors_0'.*requires_grad=True.*Plan with an example 'tensors_0' that requires grad"
    ):
        plan.module(0)(a, b.requires_grad_())
    outs = plan.simulate(lambda m, a, b: m(a, b.detach()), x, y)  # detached: fine

    def no_grad_step(module, a, b):
        with torch.no_grad():  # no gradient asked: fine
            return module(a, b.requires_grad_())

    outs_no_grad = plan.simulate(no_grad_step, x, y)
    assert all(torch.equal(o, x + y) for o in outs + outs_no_grad)


def test_check_compares_every_rank_output_and_input_gradient():
    """A rank whose replicated output or input gradient differs from the others is named."""
    mesh = ap.Mesh((2,), ("a",))
    x, y = torch.randn(6, 4), torch.randn(4, requires_grad=True)
    plan = ap.plan(Fn(lambda x, y: x + y), mesh, args=(x, y), annotations={"x": ap.place(S(0))})
    serial = x + y
    good = serial.detach()
    assert serial_check._compare_outputs(plan, serial, [good, good], 1e-5, 1e-6) == 0.0
    with pytest.raises(ap.PlanMismatch, match="output 0 on rank 1"):
        serial_check._compare_outputs(plan, serial, [good, good + 1], 1e-5, 1e-6)
    whole = torch.ones(4)
    serial_check._compare_input_grads(plan, {1: whole}, [{1: whole}, {1: whole}], 1e-5, 1e-6)
    with pytest.raises(ap.PlanMismatch, match="gradient of input 'tensors_0' on rank 0"):  # in parts
        serial_check._compare_input_grads(plan, {1: whole}, [{1: whole / 2}, {1: whole / 2}], 1e-5, 1e-6)


class SoftTargets(nn.Module):
    def __init__(self, classes=4, weight=None, smoothing=0.0):
        super().__init__()
        self.fc = nn.Linear(6, classes)
        self.weight, self.smoothing = weight, smoothing

    def forward(self, x, target):
        logits = self.fc(x)
        if logits.dim() == 3:  # (N, L, C) -> (N, C, L)
            logits = logits.transpose(1, 2)
        return F.cross_entropy(logits, target, weight=self.weight, label_smoothing=self.smoothing)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("variant", ["plain", "weighted", "smoothed", "spatial"])
def test_cross_entropy_with_class_probabilities_over_split_rows(mesh_shape, variant):
    torch.manual_seed(0)
    mesh = ap.Mesh(mesh_shape, ("dp", "tp")[: len(mesh_shape)])
    model = SoftTargets(weight=torch.rand(4) if variant == "weighted" else None)
    model.smoothing = 0.1 if variant == "smoothed" else 0.0
    x = torch.randn(8, 3, 6) if variant == "spatial" else torch.randn(8, 6)
    target = torch.randn(8, 4, 3).softmax(1) if variant == "spatial" else torch.randn(8, 4).softmax(-1)
    plan = ap.plan(model, mesh, args=(x, target), data_parallel="dp")
    report = plan.check(x, target)
    assert report["max_rel"] < 1e-5
    ce = next(n for n in plan.graph.nodes if "cross_entropy" in n.name)
    assert "split_rows" in plan.layout(ce.name).reason  # the rows stay split


class EmbedAsInput(nn.Module):
    def forward(self, ids, weight):
        return F.embedding(ids, weight) * 2


class LinearCrossEntropy(nn.Module):
    def forward(self, x, weight, target):
        return F.cross_entropy(x @ weight.t(), target)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_lowerings_read_dynamic_dims_of_inputs(mesh_shape):
    """A vocabulary split of a weight passed as an input: its row count is a dynamic dim, read
    from the local piece at run time (the generated code named an undefined symbol)."""
    mesh = ap.Mesh(mesh_shape, ("a", "b")[: len(mesh_shape)])
    vocab = _first_axis(mesh, S(0))
    gen = torch.Generator().manual_seed(0)
    ids, weight = torch.randint(0, 8, (4, 3), generator=gen), torch.randn(8, 6, generator=gen).requires_grad_()
    plan = ap.plan(EmbedAsInput(), mesh, args=(ids, weight), annotations={"weight": vocab})
    assert plan.check(ids, weight)["input_grads"] == 1
    x, target = torch.randn(4, 6, generator=gen).requires_grad_(), torch.randint(0, 8, (4,), generator=gen)
    plan = ap.plan(LinearCrossEntropy(), mesh, args=(x, weight, target), annotations={"weight": vocab})
    assert plan.check(x, weight, target)["input_grads"] == 2
    ce = next(n for n in plan.graph.nodes if "cross_entropy" in n.name)
    assert "vocab_parallel" in plan.layout(ce.name).reason


@pytest.mark.parametrize("mode", ["compiled", "no_grad"])
def test_input_gradient_compiled_and_forward_only(mode):
    """A compiled rank module gives every rank the whole gradient of a replicated input; under
    no_grad an input that requires grad runs (nothing to refuse) and equals serial."""
    mesh = ap.Mesh((2,), ("a",))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen).requires_grad_()
    fn = BROADCASTS["add"][0]
    plan = ap.plan(Fn(lambda x, y: fn(x, y).tanh()), mesh, args=(x, y), annotations={"x": ap.place(S(0))})
    serial_y = y.detach().clone().requires_grad_()
    serial_out = (x + serial_y).tanh()
    serial_out.sum().backward()

    def step(module, a, b):
        b = b.detach().clone().requires_grad_()
        if mode == "no_grad":
            with torch.no_grad():
                return module(a, b), None
        out = torch.compile(module)(a, b)
        out.sum().backward()
        return out.detach(), b.grad

    for out, grad in plan.simulate(step, x, y):
        torch.testing.assert_close(out, serial_out.detach())
        if mode == "compiled":
            torch.testing.assert_close(grad, serial_y.grad)
