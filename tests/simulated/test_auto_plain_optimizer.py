"""The user's plain torch.optim loop on the plan the search chose (issue 40, item 6): with no
budget, ZeRO-2 tied ZeRO-0 on a small model and won on memory, and torch.optim.AdamW was then
refused at the first backward. Ties now go to a storage a plain optimizer steps; explain says
why a section is empty."""

from __future__ import annotations

import copy

import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks
from tests.harness.models import gpt_batch, small_gpt

DATA = gpt_batch(batch=8, seq=16)


def test_search_without_budget_keeps_a_plain_optimizer_working():
    model = small_gpt()
    serial = copy.deepcopy(model)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=DATA, data_parallel="dp", auto=True)
    assert plan.data_parallel.storage.plain_optimizer, plan.built["auto"]["chosen"]
    tied = [r for r in plan.built["auto"]["runners_up"] if r["time_s"] == plan.built["auto"]["time_s"]]
    assert any("ZeRO-2" in r["option"] for r in tied)  # the tie the user met
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]

    def step(rank):
        module = modules[rank]
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)  # the loop the user wrote
        args, _ = plan.local_inputs(rank, *DATA)
        module(*args)[1].backward()
        opt.step()

    run_ranks(plan.mesh.size, step, timeout=60)
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    serial(*DATA)[1].backward()
    opt.step()
    merged = plan.merge_state_dicts([dict(m.named_parameters()) for m in modules])
    for name, p in serial.named_parameters():
        # Adam's first step is about lr x the gradient's sign: a near-zero gradient's rounding moves
        # an element by up to lr (1e-2), a wrong update by about that much
        torch.testing.assert_close(merged[name], p.detach(), rtol=1e-4, atol=1e-4)


def test_explain_says_why_components_and_runners_up_are_empty():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).relu().sum()

    plan = ap.plan(Tiny(), ap.Mesh((2,), ("dp",)), args=(torch.randn(4, 8),), data_parallel="dp", auto=True)
    text = str(plan.explain("auto"))
    comps = text.split("components (")[1].split("runners-up (")[0]
    assert "none: nothing here can be split on a tensor-parallel axis" in comps
    assert "<- chosen" in text.split("runners-up (")[1]
    only = ap.plan(
        Tiny(), ap.Mesh((2,), ("dp",)), args=(torch.randn(4, 8),), data_parallel="dp",
        auto=ap.Auto(zero=(0,), activation_checkpoint=(None,), pipeline=False),
    )  # fmt: skip
    assert "none: the chosen option was the only one" in str(only.explain("auto"))
