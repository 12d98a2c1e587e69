"""The fuzzer's issue-32 modes: what a training loop meets beyond forward and backward, on
random plans. Each runs on a deterministic subset of the cases (modes.selected):

- random_replicas: a model with random ops (noise blocks), planned with rng="placement": ranks
  that hold the same output (they differ on replicated axes only) got bit-identical draws;
- optimizer: a torch.optim class picked by the case, through ap.Optimizer on every rank, two
  steps: the merged parameters equal the serial model's after the same steps;
- bf16: the cases under the bf16 policy (DataParallel(param_dtype=bf16), or ap.MixedPrecision
  where the plan has no data parallelism): outputs and gradients within bf16 tolerance of the
  serial model under the same policy;
- grad_scaler: ap.GradScaler over ap.Optimizer: an inf in one rank's gradient piece, and every
  rank skips; the clean step after it equals serial SGD;
- state_dict: every rank's checkpoint boxes of every tensor (what ap.get_state_dict describes,
  blocked shards and zero=3 pieces included), assembled as Pieces.full_tensor() does, are the
  serial tensor, bit for bit.

Example:
    >>> check_optimizer(case, plan, args)      # raises on a wrong number
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import torch
import torch.utils._pytree as pytree

import autopar as ap
from autopar.checkpoint.pieces import assemble
from autopar.checkpoint.target import Target
from autopar.runtime.serial_check import _compare, _objective, _weights
from autopar.placement import shard_tensor
from autopar.runtime.simulator import run_ranks

# (class, options): adaptive optimizers divide by a gradient's magnitude, and a gradient that is
# zero in exact arithmetic (a linear's bias before a batch norm, a key bias under softmax) is
# float noise that such a division blows up to the learning rate; an eps well above that noise
# keeps the comparison about the plan (Rprop's sign steps would flip on noise: left out). Muon is
# left out too: it maps every nonzero singular value of a gradient to about 1, so float noise in a
# gradient's near-null directions (an attention's keys) becomes a full-size update on either side
# (tests/simulated/test_optimizers.py checks it on well-conditioned models).
OPTIMIZERS = (
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("AdamW", dict(lr=0.01, eps=1e-3)),
    ("Adagrad", dict(lr=0.01, eps=1e-3)),
    ("RMSprop", dict(lr=0.01, eps=1e-3)),
    ("NAdam", dict(lr=0.01, eps=1e-3)),
    ("Adafactor", dict(lr=0.01, eps=(1e-3, 1e-3))),
)
BF16_RTOL, BF16_ATOL = 5e-2, 2e-2  # serial_check.TOLERANCES' bf16 entry, atol for sums of bf16 products


def _pick(case: dict, choices: tuple, salt: str):
    digest = hashlib.sha1((json.dumps(case, sort_keys=True) + salt).encode()).hexdigest()
    return choices[int(digest[:8], 16) % len(choices)]


def _local_weights(plan, weights):
    return [
        [None if w is None else shard_tensor(w, s, plan.mesh, r) for w, s in zip(weights, plan.output_specs)]
        for r in plan.mesh.ranks()
    ]


def check_random_replicas(case, plan, args) -> None:
    """rng="placement": the outputs of ranks that differ on replicated axes only are equal."""
    from .spec import draws_random, plan_case

    if not draws_random(case):
        return
    placed, args = plan_case(case, rng="placement")

    def step(module, *a):
        ap.manual_seed(module, 7)
        return module(*a)

    outs = placed.simulate(step, *args)
    mesh, dp = placed.mesh, placed.dp_axis
    for r in mesh.ranks():
        twin = mesh.rank_of([c if a == dp else 0 for a, c in enumerate(mesh.coords(r))])
        for x, y in zip(pytree.tree_leaves(outs[r]), pytree.tree_leaves(outs[twin])):
            if isinstance(x, torch.Tensor) and not torch.equal(x, y):
                raise AssertionError(f"rng='placement': ranks {r} and {twin} hold one value but drew differently")


def check_optimizer(case, plan, args, steps=2) -> None:
    """ap.Optimizer with a class picked by the case: parameters after ``steps`` equal serial's."""
    from .spec import draws_random

    name, kw = _pick(case, OPTIMIZERS, "optimizer")
    cls = getattr(torch.optim, name)
    model = copy.deepcopy(plan.model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return
    select = (lambda n, s: len(s) == 2) if name == "Muon" else None
    if name == "Muon" and not any(p.dim() == 2 for p in trainable):
        return
    seed = 1234 if draws_random(case) else None
    weights = _weights(plan, model(*args))
    opt = cls([p for p in trainable if select is None or p.dim() == 2], **kw)
    for _ in range(steps):
        if seed is not None:
            torch.manual_seed(seed)
        _objective(model(*args), weights).backward()
        opt.step()
        opt.zero_grad()
    state = {n: p.detach() for n, p in plan.model.named_parameters(remove_duplicate=False)}
    local_w, inputs = _local_weights(plan, weights), [plan.local_inputs(r, *args) for r in plan.mesh.ranks()]
    if plan.data_parallel is not None and plan.data_parallel.zero in (1, 2):
        return  # the fuzz plans use zero 0 and 3 (ZeRO-1/2 with ap.Optimizer: tests/simulated/test_optimizers.py)

    def step(rank):
        module = plan.build_module(rank, state)
        o = ap.Optimizer(module, cls, params=select, **kw)
        for _ in range(steps):
            if seed is not None:
                ap.manual_seed(module, seed)
            a, k = inputs[rank]
            _objective(module(*a, **k), local_w[rank]).backward()
            o.step()
            o.zero_grad()
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    merged = plan.merge_state_dicts(run_ranks(plan.mesh.size, step))
    atol = 5e-4 if name == "Muon" else 1e-5  # Muon orthogonalises in bf16 (tests/simulated/test_optimizers.py)
    for n, p in model.named_parameters():
        _compare(f"{name} step: parameter {n!r}", p.detach(), merged[n], 1e-4, atol)


def check_bf16(case, plan, args) -> None:
    """The bf16 policy vs the serial model computing in bf16 from fp32 masters: as
    DataParallel(param_dtype=bf16) where the plan has data parallelism, as ap.MixedPrecision
    (tensor, context or expert parallelism alone) where it has none."""
    from .spec import draws_random

    if draws_random(case) or any(b["kind"] == "bn" for b in case["blocks"]):
        return  # (batch norm's fp32 running statistics do not run with bf16 weights, serial either)
    dp = plan.data_parallel
    if dp is not None:
        policy = plan.with_data_parallel(dataclasses.replace(dp, param_dtype=torch.bfloat16))
    else:
        policy = plan.with_options(plan.options.replace(mixed_precision=ap.MixedPrecision(torch.bfloat16)))
    model = plan.model
    low = {n: p.detach().to(torch.bfloat16).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    cast = [a.to(torch.bfloat16) if a.is_floating_point() else a for a in args]
    serial_out = torch.func.functional_call(model, low, tuple(cast))
    weights = _weights(plan, serial_out.float())
    objective = _objective(serial_out.float(), weights)
    if objective.requires_grad:
        objective.backward()
    local_w = _local_weights(plan, weights)
    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}

    def step(rank):
        module = policy.build_module(rank, state)
        a, k = policy.local_inputs(rank, *args)
        out = module(*a, **k)
        obj = _objective(out.float(), local_w[rank])
        if obj.requires_grad:
            obj.backward()
        return out, {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    # the policy's program (a trace in the low dtype) made here, not lazily by the first rank thread
    # under run_ranks' timeout: on a loaded machine the trace outlived it, and the abandoned
    # thread's torch.export then broke the next case's serial run (a fake tensor in its forward)
    policy.program  # noqa: B018
    results = run_ranks(policy.mesh.size, step)
    merged = policy.merge_outputs([r[0] for r in results])
    _compare("bf16 output", serial_out.float().detach(), merged.float(), BF16_RTOL, BF16_ATOL)
    grads = policy.merge_state_dicts([r[1] for r in results])
    scale = max((p.grad.abs().max().item() for p in low.values() if p.grad is not None), default=0.0)
    for n, p in low.items():
        if p.grad is not None and grads.get(n) is not None:
            _compare(
                f"bf16 gradient of {n!r}", p.grad.float(), grads[n].float(), BF16_RTOL, BF16_ATOL * max(scale, 1.0)
            )


def check_grad_scaler(case, plan, args) -> None:
    """ap.GradScaler over ap.Optimizer(SGD): an inf in one drawn rank's gradient piece makes every
    rank skip and back off (parameters unchanged), and the clean step after it equals serial SGD
    (the scale a power of two, so unscaling is exact)."""
    from autopar.parallel.grad_scaler import stepped_tensors

    from .spec import draws_random

    model = copy.deepcopy(plan.model)
    if draws_random(case) or not any(p.requires_grad for p in model.parameters()):
        return
    weights = _weights(plan, model(*args))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    _objective(model(*args), weights).backward()
    opt.step()
    state = {n: p.detach() for n, p in plan.model.named_parameters(remove_duplicate=False)}
    local_w, inputs = _local_weights(plan, weights), [plan.local_inputs(r, *args) for r in plan.mesh.ranks()]
    if plan.data_parallel is not None and plan.data_parallel.zero in (1, 2):
        return  # as check_optimizer: the fuzz plans use zero 0 and 3
    bad = _pick(case, tuple(plan.mesh.ranks()), "grad_scaler")

    def step(rank):
        module = plan.build_module(rank, state)
        o = ap.Optimizer(module, torch.optim.SGD, lr=0.05)
        scaler, scales, after_skip, injected = ap.GradScaler(module, init_scale=2.0**10), [], None, False
        for inject in (True, False):
            a, k = inputs[rank]
            scaler.scale(_objective(module(*a, **k), local_w[rank])).backward()
            held = [t for t in stepped_tensors(o) if t.grad is not None and t.grad.numel()]
            if inject and rank == bad and held:
                held[0].grad.view(-1)[0], injected = float("inf"), True
            scaler.step(o)
            scaler.update()
            scales.append(scaler.get_scale())
            o.zero_grad()
            if inject:
                after_skip = {n: p.detach().clone() for n, p in module.named_parameters()}
        return scales, after_skip, {n: p.detach().clone() for n, p in module.named_parameters()}, injected

    results = run_ranks(plan.mesh.size, step)
    if not results[bad][3]:
        return  # the drawn rank holds no gradient element (an uneven ZeRO-3 piece): nothing to inject
    for rank, (scales, *_) in enumerate(results):
        if scales != [2.0**9, 2.0**9]:
            raise AssertionError(f"GradScaler: rank {rank}'s scales {scales} (inf on rank {bad}): not [2**9, 2**9]")
    skipped = plan.merge_state_dicts([r[1] for r in results])
    for n, p in state.items():
        if n in skipped and not torch.equal(skipped[n], p):
            raise AssertionError(f"GradScaler: parameter {n!r} moved on the step rank {bad}'s inf should skip")
    merged = plan.merge_state_dicts([r[2] for r in results])
    for n, p in model.named_parameters():
        _compare(f"GradScaler step: parameter {n!r}", p.detach(), merged[n], 1e-4, 1e-5)


def check_state_dict(case, plan, args) -> None:
    """Every rank's checkpoint boxes of every tensor, assembled: the serial tensor exactly."""
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]
    targets = [Target.of(m) for m in modules]
    serial = dict(plan.model.state_dict())
    for fqn in targets[0].names():
        everyone = []
        for t in targets:
            local = t.tensors[fqn].detach()
            everyone.append([(off, size, v) for off, size, v in t.boxes(fqn, local, t.stored_start(fqn))])
        full = assemble(serial[fqn].shape, serial[fqn].dtype, everyone)
        if not torch.equal(full, serial[fqn]):
            raise AssertionError(f"state dict: the ranks' boxes of {fqn!r} do not assemble to the serial tensor")
