"""Comparing a parallel run with the serial model: parameters after steps, gradients, losses.

Errors are relative to the size of each serial parameter (a "model-scaled" error), so one
bound holds for every tensor whatever its scale.

    >>> merged = plan.merge_state_dicts(per_rank_params)
    >>> assert max_rel_diff(merged, dict(serial.named_parameters())) < 1e-5
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from autopar.placement import shard_tensor


def max_rel_diff(got: dict, ref: dict) -> float:
    """The worst max|got - ref| / max|ref| over the parameters of ``ref`` (by serial name)."""
    return max(((got[n] - p.detach()).abs().max() / p.detach().abs().max()).item() for n, p in ref.items())


def assert_params_close(got: dict, ref: dict, where: str = "", rtol=1e-5, atol=1e-6) -> None:
    """Every parameter of ``ref`` equals ``got``'s within rtol/atol; the failure names it."""
    for n, p in ref.items():
        torch.testing.assert_close(got[n], p.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{where} {n}: {m}")


def sgd_step(module, lr: float, loss) -> None:
    """Plain SGD by hand (no optimizer state): backward, p -= lr * grad, grads cleared."""
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def serial_step(model, batch, loss_fn=None, labels=None):
    """A deep copy of ``model`` trained one step on the whole batch: (loss, {name: grad}).

    Without ``loss_fn`` the model returns (logits, loss), as the GPT does."""
    ref = copy.deepcopy(model)
    out = ref(*batch)
    loss = loss_fn(out, labels) if loss_fn else out[1]
    loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    return loss.detach(), grads


def grad_errors(plan, rank: int, runner, serial_grads: dict, rtol=1e-5, atol=1e-6) -> list[str]:
    """Every parameter this rank's pipeline runner holds (tied names too) against its piece of
    the serial gradient; returns one line per mismatch."""
    bad = []
    for name, p in runner.params.items():
        if not isinstance(p, nn.Parameter):
            continue
        ref = shard_tensor(serial_grads[name], plan.param_specs[name], plan.mesh, rank)
        if p.grad is None or not torch.allclose(p.grad, ref, rtol=rtol, atol=atol):
            diff = None if p.grad is None else (p.grad - ref).abs().max().item()
            bad.append(f"rank {rank} {name}: max diff {diff}")
    return bad


def covered(runners_params: list[dict], model) -> set:
    """The model's parameter names that no runner holds (empty: every parameter has a home)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return names - {n for d in runners_params for n in d}
