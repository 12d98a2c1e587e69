"""Helpers the float8 tests share: a plan's eval-mode outputs, its collectives' bytes as listed
against as ran, and an HF-style model's gradients over every rank.

Example:
    >>> outs, stats = eval_outputs(plan, x)
    >>> planned, ran = listed_and_ran_bytes(plan, {(0, 1): "tp"}, loss, x)
    >>> grads, stats = loss_grads(plan, {"input_ids": ids, "labels": labels})
"""

from __future__ import annotations

import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks


def eval_outputs(plan, x):
    """Every rank's output of ``x`` in eval mode under torch.no_grad, and the collectives they ran."""

    def rank(r):
        m = plan.build_module(r).eval()
        (a,), _ = plan.local_inputs(r, x)
        with torch.no_grad():
            return m(a)

    with ap.comm_stats() as stats:
        outs = run_ranks(plan.mesh.size, rank)
    return outs, stats


def listed_and_ran_bytes(plan, label: dict, loss, x):
    """One training step's bytes by (kind, axis): as plan.collectives() lists them, and as rank 0
    ran them (``label``: rank group -> the axis name plan.collectives() gives it); and the stats."""
    planned: dict = {}
    for c in plan.collectives():
        planned[(c.kind, c.axis)] = planned.get((c.kind, c.axis), 0) + float(c.bytes)
    with ap.comm_stats() as stats:
        plan.simulate(lambda m, a: loss(m(a)).backward(), x)
    ran: dict = {}
    for r in stats.for_rank(0):
        ran[(r.kind, label[r.group])] = ran.get((r.kind, label[r.group]), 0) + r.bytes
    return planned, ran, stats


def loss_grads(plan, kw: dict):
    """Every rank's gradients of the model's loss (its output [1], an HF causal LM given labels)
    on ``kw``, merged under the serial model's names, and the collectives the ranks ran."""

    def rank(r):
        m = plan.build_module(r)
        _, local = plan.local_inputs(r, **kw)
        m(**local)[1].backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    with ap.comm_stats() as stats:
        grads = plan.merge_state_dicts(run_ranks(plan.mesh.size, rank))
    return grads, stats
