"""The precision policy's reference (FSDP2's MixedPrecisionPolicy run serially) and its training loop.

The reference computes with bf16 copies of fp32 master parameters, as FSDP2 does after its gather
(``torch.func.functional_call`` with ``p.to(bf16)``): autograd takes the gradient back through the
cast, so it lands in fp32 on the masters, which the optimizer steps.

>>> ref = serial_policy(copy.deepcopy(model), kw, torch.bfloat16)
>>> got = policy_train(plan, kw, zero=3)
>>> assert rel_diff(got, ref, dict(model.named_parameters())) < BF16_REL
"""

from __future__ import annotations

import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks

# after two SGD steps at lr 0.1 a tiny LM's updates under bf16 compute differ from the reference's by
# the order of bf16 sums: measured at most 7e-3 with data parallel (Gemma2), 1.5e-2 with tensor
# parallelism (Gemma2: a row-parallel layer's partial sums rounded to bf16 before their all-reduce,
# as Megatron's are); fp32's updates are 8e-3 to 2e-2 away
BF16_REL = 3e-2


def loss_of(out):
    return (out.loss if hasattr(out, "loss") else out["loss"]).float()


def serial_policy(model, kw, dtype, steps=2, lr=0.1):
    """``model`` trained serially under the policy: computing in ``dtype`` from fp32 masters
    (None: in fp32); (its fp32 parameters, the losses)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        low = {n: p.to(dtype) if dtype else p for n, p in model.named_parameters()}
        loss = loss_of(torch.func.functional_call(model, low, (), kw))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def policy_train(plan, kw, zero, steps=2, lr=0.1):
    """SGD steps on every rank under the plan's policy: (the merged fp32 parameters, rank 0's losses)."""

    def step(rank):
        module = plan.build_module(rank)
        opt = ap.ZeroOptimizer(module, torch.optim.SGD, lr=lr) if zero in (1, 2) else None
        opt = opt or torch.optim.SGD(module.parameters(), lr=lr)
        _, local = plan.local_inputs(rank, **kw)
        losses = []
        for _ in range(steps):
            loss = loss_of(module(**local))
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in module.named_parameters()}, losses

    results = run_ranks(plan.mesh.size, step)
    return plan.merge_state_dicts([r[0] for r in results]), results[0][1]


def rel_diff(got: dict, ref: dict, init: dict) -> float:
    """The largest relative distance of the updates, ||(got - init) - (ref - init)|| / ||ref - init||,
    over the parameters that moved (the parameters themselves hide the updates' differences)."""
    out = 0.0
    for n, p in ref.items():
        step = p - init[n]
        if step.norm() > 0:
            out = max(out, ((got[n] - p).norm() / step.norm()).item())
    return out
