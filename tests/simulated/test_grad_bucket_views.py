"""Gradients living in their buckets (parallel/grad_sync.py), simulated: every .grad is a view of
its bucket's flat buffer, a step does nothing per parameter that autograd does not (no
concatenation, no copy back, no per-gradient division), ZeRO-2 keeps no full-size gradient,
and the buckets are rebuilt from the order gradients really arrive in."""

from __future__ import annotations

import collections
import cProfile
import pstats

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import autopar as ap
from autopar.parallel import dp_module
from autopar.runtime.simulator import SimBackend, run_ranks
from tests.harness import data_parallel as H

_PLANS: dict = {}


def plan_for(mesh_name="dp2", **options):
    if mesh_name not in _PLANS:
        _PLANS[mesh_name] = H.make_plan(mesh_name)
    return _PLANS[mesh_name].with_data_parallel(ap.DataParallel("dp", **options))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops a block runs (it only observes: the eager fast paths stay on)."""

    observer = True

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Unseen:
    """A backend whose own ops (the simulator's copies) the counter does not see: what is
    counted is the gradient sync's work around the collectives."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with _disable_current_modes():
                out = attr(*args, **kwargs)
            return Unseen(out) if hasattr(out, "wait") else out

        return call


def _flat_of(sync, name):
    i, _, _ = sync.where[name]
    return sync.slots[i].flat


@pytest.mark.parametrize("option", ["default", "buckets2", "zero1", "bf16", "localsgd2"])
def test_gradients_are_views_of_their_bucket(option):
    plan = plan_for(**H.OPTIONS[option])

    def step(rank):
        module = plan.build_module(rank)
        sync = module.autopar_grad_sync
        opt = H.make_optimizer(module, "sgd", plan.data_parallel.zero)
        for x in H.batches(2):
            H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
            for name, p in module.named_parameters():
                assert p.grad.untyped_storage().data_ptr() == _flat_of(sync, name).untyped_storage().data_ptr(), name
            opt.step()
            opt.zero_grad()  # set_to_none: the next backward's gradients are copied in once

    run_ranks(2, step, timeout=30)


def test_zero2_keeps_no_full_size_gradient():
    plan = plan_for(**H.OPTIONS["zero2"])

    def step(rank):
        module = plan.build_module(rank)
        opt = H.make_optimizer(module, "sgd", 2)
        H.loss_of(module(plan.local_inputs(rank, H.batches(1)[0])[0][0])).backward()
        assert all(p.grad is None for p in module.parameters())
        assert all(s.flat is None for s in module.autopar_grad_sync.slots)  # the step's buffers are gone
        assert any(p.grad is not None for g in opt.param_groups for p in g["params"])

    run_ranks(2, step, timeout=30)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_step_does_nothing_per_parameter(set_to_none):
    """After the first step: no concatenation, no copy back, no division. With
    zero_grad(set_to_none=False) autograd accumulates into the views and the sync adds no op
    but the collectives; with set_to_none=True each fresh gradient is copied in once."""
    plan = plan_for(bucket_max_params=3)
    n_params = len(list(H.make_model().parameters()))

    def step(rank):
        module = plan.build_module(rank)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        xs = [plan.local_inputs(rank, x)[0][0] for x in H.batches(3)]
        counts = []
        for i, x in enumerate(xs):
            loss = H.loss_of(module(x))
            with OpCounter() as c:
                loss.backward()
            counts.append(c.ops)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return counts[1:]

    for ops in run_ranks(2, step, timeout=30, backend=Unseen(SimBackend(2)))[0]:
        assert not {"cat", "_foreach_copy_", "div_", "mul_", "split_with_sizes"} & set(ops), ops
        assert ops.get("copy_", 0) == (n_params if set_to_none else 0), ops


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_step_runs_one_python_call_per_gradient(set_to_none):
    """Python frames of the sync in a step after the first (forward and backward): one hook call
    per gradient, every other function of grad_sync.py at most once per bucket (no generator
    or helper per parameter: the held-gradient check of the forward runs in C)."""
    plan = plan_for(bucket_max_params=3)
    n_params, n_buckets = len(list(H.make_model().parameters())), len(plan.grad_buckets())

    def step(rank):
        module = plan.build_module(rank)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        calls = []
        for x in H.batches(3):
            prof = cProfile.Profile()
            prof.enable()
            H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
            prof.disable()
            stats = pstats.Stats(prof).stats
            calls.append({fn: row[1] for (path, _, fn), row in stats.items() if path.endswith("grad_sync.py")})
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return calls[1:]

    for calls in run_ranks(2, step, timeout=30)[0]:
        assert calls.pop("hook") == n_params, calls
        assert calls and max(calls.values()) <= n_buckets, sorted(calls.items())


def test_buckets_rebuilt_from_the_order_gradients_arrive_in(monkeypatch):
    plan = plan_for(bucket_max_params=2)
    arrived = [b.names for b in plan.grad_buckets()]  # the planned order is backward's here
    wrong = dp_module.param_order(plan)[::-1]  # first use first: the last gradients first
    monkeypatch.setattr(dp_module, "param_order", lambda plan: wrong)
    assert [b.names for b in plan.grad_buckets()] != arrived

    def train(rank):
        module = plan.build_module(rank)
        sync = module.autopar_grad_sync
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        seen = []
        for x in H.batches():
            seen.append([b.names for b in sync.buckets])
            H.loss_of(module(plan.local_inputs(rank, x)[0][0])).backward()
            opt.step()
            opt.zero_grad()
        seen.append([b.names for b in sync.buckets])
        return seen, {n: p.detach().clone() for n, p in module.named_parameters()}

    out = run_ranks(2, train, timeout=30)
    for seen, _ in out:
        assert seen[0] != arrived and all(s == arrived for s in seen[1:])
    H.compare(plan.merge_state_dicts([params for _, params in out]), H.train_serial("sgd"), "default", "rebuilt")
