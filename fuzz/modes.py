"""The fuzzer's training-loop modes: each case's plan also run compiled, in eval mode, and with
dropout in the serial RNG mode, against the serial model (one function per mode).

Each mode runs on a deterministic subset of the cases (``selected``): the modes cost more
than the plain check (a second trace for the dropout variant, an inductor compile per rank),
and the subset keeps CI's fuzz time bounded; ``make fuzz`` goes through the same subsets of
many more cases.

Example:
    >>> compare_with_serial(plan, args, wrap=torch.compile)          # forward and gradients
    >>> run_modes(case, plan, args)                                 # the modes this case is picked for
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import torch
import torch.utils._pytree as pytree

import autopar as ap
from autopar.runtime.serial_check import _compare, _objective, _weights
from autopar.placement import shard_tensor
from autopar.runtime.simulator import run_ranks

EVERY = {"eval": 10, "dropout": 8, "compiled": 60}  # one case in N runs the mode
# issue 32's modes (fuzz/user_modes.py)
EVERY.update({"random_replicas": 2, "optimizer": 6, "bf16": 8, "state_dict": 4, "grad_scaler": 8})
RTOL, ATOL = 1e-4, 1e-5
MAX_COMPILED_RANKS = 2


def _size(case) -> int:
    n = 1
    for s in case["mesh"][0]:
        n *= s
    return n


def selected(case: dict, mode: str) -> bool:
    """Whether ``case`` runs ``mode``: a hash of the case, so the same cases every run. Compiled
    runs take meshes of at most MAX_COMPILED_RANKS ranks (inductor compiles once per rank, several
    seconds each on a small CPU); tests/test_training_loop.py compiles on larger meshes. Nor MoE
    blocks (below)."""
    if mode == "compiled" and _size(case) > MAX_COMPILED_RANKS:
        return False
    if mode == "compiled" and any(b["kind"] == "moe" for b in case["blocks"]):
        return False  # ~14 graphs at the dispatch's data-dependent sizes, ~6 s of inductor a case
        # (docs/experts.md "torch.compile"; tests/gloo/test_expert_parallel.py compiles one)
    digest = hashlib.sha1((json.dumps(case, sort_keys=True) + mode).encode()).hexdigest()
    return int(digest[:8], 16) % EVERY[mode] == 0


def run_modes(case: dict, plan, args) -> list[str]:
    """Run the modes ``case`` is selected for; a mismatch raises. Returns the modes run."""
    from .user_modes import check_bf16, check_grad_scaler, check_optimizer, check_random_replicas, check_state_dict

    done = []
    checks = (
        ("eval", check_eval),
        ("dropout", check_dropout_serial),
        ("compiled", check_compiled),
        ("random_replicas", check_random_replicas),
        ("optimizer", check_optimizer),
        ("bf16", check_bf16),
        ("grad_scaler", check_grad_scaler),
        ("state_dict", check_state_dict),
    )
    for mode, check in checks:
        if selected(case, mode):
            check(case, plan, args)
            done.append(mode)
    return done


def _seed(case):
    """The seed both sides draw from when the model has random ops (noise blocks)."""
    from .spec import draws_random

    return 1234 if draws_random(case) else None


def check_eval(case, plan, args) -> None:
    """Eval mode, with dropout in the model: no_grad and inference_mode forwards equal serial's."""
    plan, args = _dropout_plan(case, "serial" if _seed(case) else "placement") or (plan, args)
    for ctx in (torch.no_grad, torch.inference_mode):
        compare_with_serial(plan, args, train=False, ctx=ctx, seed=_seed(case))


def check_dropout_serial(case, plan, args) -> None:
    """Dropout on, rng="serial": forward and gradients equal serial's (same seed)."""
    found = _dropout_plan(case, "serial")
    if found is not None:
        compare_with_serial(*found, seed=1234)


def check_compiled(case, plan, args) -> None:
    """Every rank's module under torch.compile (inductor): forward and gradients, twice."""
    compare_with_serial(plan, args, wrap=torch.compile, calls=2, seed=_seed(case))


def _dropout_plan(case, rng: str):
    """The case's model with dropout after every activation, planned with ``rng`` (None when
    the variant is refused with a PlanError)."""
    from .spec import plan_case

    variant = dict(case, dropout=0.25)
    try:
        return plan_case(variant, rng=rng)
    except ap.PlanError:
        return None


def compare_with_serial(
    plan, args, wrap=None, train=True, ctx=contextlib.nullcontext, seed=None, calls: int = 1
) -> None:
    """Serial model vs every rank (simulated) in one training-loop setting; raises PlanMismatch.

    ``wrap``: applied to each rank module (torch.compile); ``train``: the modules' mode (and a
    backward when True); ``ctx``: the grad mode of the forward; ``seed``: torch.manual_seed for
    serial, ap.manual_seed for the ranks, before each call; ``calls``: forwards (and backwards) in
    a row, every one compared (gradients accumulate on both sides)."""
    model = plan.model
    model.train(train)
    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    modules = [plan.build_module(r, state).train(train) for r in plan.mesh.ranks()]
    runs = [wrap(m) if wrap else m for m in modules]
    inputs = [plan.local_inputs(r, *args) for r in plan.mesh.ranks()]
    try:
        for _ in range(calls):
            _one_call(plan, model, modules, runs, inputs, args, train, ctx, seed)
    finally:
        model.train(True)
        model.zero_grad(set_to_none=True)


def _backward(objective) -> None:
    """Backward where there is something to differentiate: a model of activation blocks only has
    no parameter, and its output no gradient (the harness called backward on it: not a finding)."""
    if torch.is_tensor(objective) and objective.requires_grad:
        objective.backward()


def _one_call(plan, model, modules, runs, inputs, args, train, ctx, seed):
    if seed is not None:
        torch.manual_seed(seed)
    with ctx():
        serial_out = model(*args)
    weights = _weights(plan, serial_out)
    if train:
        _backward(_objective(serial_out, weights))
    local_w = [
        [None if w is None else shard_tensor(w, s, plan.mesh, r) for w, s in zip(weights, plan.output_specs)]
        for r in plan.mesh.ranks()
    ]

    def step(rank):
        if seed is not None:
            with contextlib.suppress(ap.PlanError):  # no dropout in the program: nothing to seed
                ap.manual_seed(modules[rank], seed)
        a, k = inputs[rank]
        with ctx():
            out = runs[rank](*a, **k)
        if train:
            _backward(_objective(out, local_w[rank]))
        return out

    outs = run_ranks(plan.mesh.size, step)
    merged = plan.merge_outputs(outs)
    for i, (s, m) in enumerate(zip(pytree.tree_leaves(serial_out), pytree.tree_leaves(merged))):
        if isinstance(s, torch.Tensor):
            _compare(f"output {i}", s.detach(), m.detach(), RTOL, ATOL)
    if train:
        grads = [
            {n: p.grad for n, p in m.named_parameters(remove_duplicate=False) if p.grad is not None} for m in modules
        ]
        merged_g = plan.merge_state_dicts(grads)
        for name, p in model.named_parameters():
            if p.grad is not None and name in merged_g:
                _compare(f"gradient of {name!r}", p.grad, merged_g[name], RTOL, ATOL)
