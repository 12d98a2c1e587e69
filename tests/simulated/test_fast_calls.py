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


def test_parameters_are_read_from_their_modules_dicts_each_call():
    """No nn.Module.__getattr__ path per tensor and no pytree walk of flat inputs and outputs; a
    parameter replaced through the module's own API is what the next call reads."""
    plan, args = _plan()
    module = plan.build_module(0)
    code = module.code
    assert "._parameters['weight']" in code and "getattr(self.blocks" not in code
    assert "tree_flatten_spec" not in code and "tree_unflatten" not in code
    with use_backend(ShapeBackend()):
        before = module(*args)[1]
        name = "blocks.0.mlp.fc.weight"
        state = {name: torch.zeros_like(module.get_parameter(name))}
        module.load_state_dict(state, strict=False, assign=True)  # a new Parameter object
        assert module.get_parameter(name) is not None and float(module.get_parameter(name).detach().abs().sum()) == 0
        after = module(*args)[1]
    assert not torch.equal(before, after)


def test_call_site_functions_keep_constants_on_the_class():
    """A collective's call site is one autograd.Function taking the tensor alone; its backward
    reads the op's constants from the node's class, and the gradient is the op's."""
    from autopar.runtime.collectives import site_function
    from autopar.runtime.simulator import SimBackend

    x = torch.randn(3, 4, requires_grad=True)
    fn = site_function("scale_grad", ("dp", 0.25, False))
    assert fn._backward_cls.factor == 0.25
    with use_backend(SimBackend(world_size=1)):
        y = fn.apply(x)
    assert y is not x and torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 0.25))
