"""The emitted program's fast calls (codegen/fast_calls.py): torch bindings for aten ops, the
collectives' autograd.Functions in plain eager mode, the ops themselves under tracing; and
Megatron's f reducing its gradient in place where only matmul-like ops read it."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import autopar as ap
from autopar.runtime.backend import use_backend
from bench.bench_memory import ShapeBackend
from bench.models import annotations, build


def _plan():
    model, args = build("gpt", "tiny")
    return ap.plan(model, ap.Mesh((2,), ("tp",)), args=args, annotations=annotations("gpt")), args


def test_code_calls_torch_bindings_and_eager_collectives_and_equals_serial():
    plan, args = _plan()
    code = plan.module(0).code
    assert "torch._C._nn.linear(" in code and "torch.ops.aten.linear" not in code
    assert "eager_autopar.all_reduce.default(" in code and "eager_autopar.grad_all_reduce.default(" in code
    assert "grad_owned = plain_eager" in code  # f before qkv and fc: only a linear reads it
    assert plan.check(*args)["max_rel"] < 1e-5


def test_a_tracer_still_records_the_ops():
    plan, args = _plan()
    module = plan.build_module(0)
    with use_backend(ShapeBackend()):  # one rank alone: collectives of the right shapes
        traced = make_fx(lambda *a: module(*a))(*args)
    targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert torch.ops.autopar.all_reduce.default in targets
    assert torch.ops.autopar.grad_all_reduce.default in targets
