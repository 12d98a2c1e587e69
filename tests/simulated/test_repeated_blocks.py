"""Deep models traced two blocks deep and copied (trace/repeat_blocks.py): the same graph as a full export,
or a full export where copying would not be safe."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autopar as ap
from autopar.trace.repeat_blocks import find_repeated
from autopar.trace.export import trace
from tests.harness import hf_models
from tests.harness.models import MEGATRON, MLP, gpt_batch, small_gpt


def canonical(traced) -> list[str]:
    """The graph with node names replaced by positions and parameters by their model names."""
    nodes = list(traced.gm.graph.nodes)
    fqn = {**traced.param_fqn, **traced.buffer_fqn, **traced.constant_fqn}
    pos = {n: i for i, n in enumerate(nodes)}

    def ref(a):
        return fqn.get(a.name, f"#{pos[a]}")

    def stack(n):
        return [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]

    return [
        repr(
            (
                n.op,
                fqn.get(n.name) if n.op == "placeholder" else str(n.target),
                fx.map_arg(n.args, ref),
                fx.map_arg(n.kwargs, ref),
                stack(n),
            )
        )
        for n in nodes
    ]


def assert_same_as_full_export(model, args, kwargs=None, copied=True):
    fast = trace(model, args, kwargs)
    full = trace(model, args, kwargs, repeat_blocks=False)
    assert (fast.repeated is not None) == copied
    assert canonical(fast) == canonical(full)
    assert fast.param_fqn.keys() == full.param_fqn.keys() and fast.user_inputs == full.user_inputs
    return fast


def test_gpt_blocks_copied_graph_equals_full_export_and_numerics():
    model = small_gpt(layers=5)
    args = gpt_batch(batch=4)
    fast = assert_same_as_full_export(model, args)
    assert (fast.repeated.prefix, fast.repeated.count) == ("blocks", 5)
    plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=args, annotations=MEGATRON, data_parallel="dp")
    plan.check(*args)
    plan.check(*gpt_batch(batch=2, seq=12, seed=3))  # dynamic batch and sequence survive the copy


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_huggingface_blocks_copied(name):
    model = getattr(hf_models, name)(layers=4)
    fast = assert_same_as_full_export(model, (), hf_models.inputs(name))
    assert fast.repeated.count == 4


def test_uncalled_blocks_exported_whole():
    # tests.harness.models.MLP's blocks are ModuleDicts it never calls: its relu and residual add run
    # in the parent's forward, between the blocks, so no block is a pattern for the others.
    assert_same_as_full_export(MLP(layers=4), (torch.randn(4, 16),), copied=False)


def test_copied_plan_matches_full_plan_layouts():
    model, args = small_gpt(layers=4), gpt_batch(batch=4)
    mesh = ap.Mesh((2,), ("tp",))
    fast = ap.plan(model, mesh, args=args, annotations=MEGATRON)
    full = ap.plan(model, mesh, args=args, annotations=MEGATRON, repeat_blocks=False)
    assert fast.traced.repeated is not None and full.traced.repeated is None

    def described(plan):  # node names differ (copies are named after the tail): compare the rest
        return [re.sub(r" at \w+ ", " ", str(c)) for c in plan.collectives()]

    assert described(fast) == described(full)
    fast.check(*args)


class Block(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), scale

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale


class Indexed(nn.Module):
    """Reaches its blocks by index: the 2-block model cannot run, so the whole model is exported."""

    def __init__(self, n=4):
        super().__init__()
        self.n = n
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for i in range(self.n):
            x = self.blocks[i](x)
        return x


class Depth(nn.Module):
    """Uses its depth in the forward: len() of the short list still says 4."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x / len(self.blocks)


class EveryOutput(nn.Module):
    """The tail reads every block's output: block 1 is not a pattern for the others."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        outs = []
        for b in self.blocks:
            x = b(x)
            outs.append(x)
        return torch.stack(outs).sum(0)


class Different(nn.Module):
    """Blocks with a per-block setting (like a sliding window on some layers): not identical."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.blocks[3].scale = 0.5

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Shared(nn.Module):
    """One block used four times (ALBERT-style): its weights are not per block."""

    def __init__(self):
        super().__init__()
        block = Block()
        self.blocks = nn.ModuleList([block] * 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize(
    "cls,copied", [(Indexed, False), (Depth, True), (EveryOutput, False), (Different, False), (Shared, False)]
)
def test_unsafe_shapes_export_the_whole_model(cls, copied):
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(4, 8)
    assert_same_as_full_export(model, (x,), copied=copied)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=(x,), annotations={"blocks.0.fc": ap.colwise("tp")})
    plan.check(x)
    assert len(list(model.blocks)) == 4  # the model is given back whole


def test_find_repeated_needs_enough_blocks():
    assert find_repeated(small_gpt(layers=3)) is None
    assert find_repeated(small_gpt(layers=4)).count == 4


def test_copied_graph_runs_as_the_model():
    model, args = small_gpt(layers=4), gpt_batch(batch=2)
    traced = trace(model, args)
    weights = dict(model.named_parameters(remove_duplicate=False))
    ph = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder" and n.name in traced.param_fqn]
    logits, loss = traced.gm(*[weights[traced.param_fqn[n]] for n in ph], *args)
    want_logits, want_loss = model(*args)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(logits, want_logits)
