"""Sequence parallel (Megatron-SP) on the GPT: norms, row-parallel outputs and the embedding's
output split on the sequence dim, gathered before each column-parallel layer. Against serial,
forward and every gradient, on (2,), (4,) and (2, 2) = dp x tp; each layer's all-reduces become
all-gathers and reduce-scatters of half the bytes each. HuggingFace models: hf/test_comm.py,
hf/test_presets.py."""

from __future__ import annotations

import fnmatch
from collections import Counter

import pytest

import autopar as ap
from tests.harness.comm import runtime_matches_static
from tests.harness.meshes import TP
from tests.harness.models import GPT_SEQUENCE_PARALLEL, MEGATRON, GPT_VOCAB, gpt_batch, gpt_plan, small_gpt


def _layer_kinds(plan, i):
    return Counter((c.kind, c.phase) for c in plan.collectives() if c.module.startswith(f"blocks.{i}."))


@pytest.mark.parametrize("mesh_name", TP)
def test_gpt_sequence_parallel_matches_serial(mesh_name):
    plan = gpt_plan(mesh_name, annotations=GPT_SEQUENCE_PARALLEL)
    plan.check(*gpt_batch())
    plan.check(*gpt_batch(batch=4, seq=12, seed=5))  # another batch and sequence length (divisible by tp)
    runtime_matches_static(plan, args=gpt_batch(), loss=lambda out: out[1])
    tp = plan.mesh.axis_names.index("tp")
    assert tp in plan.grad_sync_axes["blocks.0.ln_1.weight"]  # partial over tp: summed by the gradient sync


@pytest.mark.parametrize("mesh_name", ["tp2", "tp4"])
def test_each_layer_gathers_and_scatters_instead_of_all_reducing(mesh_name):
    """Per layer: 2 all-gathers + 2 reduce-scatters forward and backward, each (n-1)/n of an
    activation, where Megatron alone runs 2 + 2 all-reduces of 2(n-1)/n: the same bytes."""
    sp = gpt_plan(mesh_name, annotations=GPT_SEQUENCE_PARALLEL)
    mega = gpt_plan(mesh_name, annotations={**MEGATRON, **GPT_VOCAB})
    n = sp.mesh.size
    activation = 8 * 8 * 32 * 4  # gpt_batch(): (B 8, S 8, H 32) float32
    for i in range(2):
        assert _layer_kinds(sp, i) == {
            ("all_gather", "forward"): 2,
            ("reduce_scatter", "forward"): 2,
            ("all_gather", "backward"): 2,
            ("reduce_scatter", "backward"): 2,
        }
        assert all(
            c.bytes == pytest.approx((n - 1) / n * activation)
            for c in sp.collectives()
            if c.module.startswith(f"blocks.{i}.")
        )
        assert _layer_kinds(mega, i) == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}
    layer_bytes = [sum(c.bytes for c in p.collectives() if c.module.startswith("blocks.")) for p in (sp, mega)]
    assert layer_bytes[0] == pytest.approx(layer_bytes[1])  # the same volume, in twice as many pieces


def test_preset_finds_the_same_annotations():
    model = small_gpt()
    preset = ap.presets.megatron(model, "tp", args=gpt_batch(), sequence_parallel=True)
    paths = [n for n, _ in model.named_modules() if n]

    def expand(ann):
        return {p: a for pat, a in ann.items() for p in paths if fnmatch.fnmatchcase(p, pat)}

    assert expand(dict(preset)) == expand(GPT_SEQUENCE_PARALLEL)
