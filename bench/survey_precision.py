"""The survey's bf16-policy mode (``python -m bench.survey --precision bf16``): each language model
planned as a user writes FSDP2's recipe (bf16 compute over fp32 masters) and held against the
serial model under the same recipe.

Plans (the survey's meshes and preset): on (2,) the Megatron preset on tp under
``ap.MixedPrecision(param_dtype=bf16)`` (no data parallel: the policy's own casts), or, without a
preset, ``ap.DataParallel("dp", zero=3, param_dtype=bf16)``; on (2, 2) dp x tp the preset beside
``ap.DataParallel("dp", zero=3, param_dtype=bf16)`` (the gathers cast).

Reference: the serial model computing with bf16 copies of its fp32 parameters
(``torch.func.functional_call`` with ``p.to(bf16)``, as tests/harness/precision.py does; the
parameters HF keeps in fp32, ``_keep_in_fp32_modules_strict``, as they are: trace/in_dtype.py), the
loss of ``labels=input_ids`` (or, where the model's own loss needs other inputs, the next-token
cross-entropy of its logits: ``NextTokenLoss``), its gradient landing in fp32 on the parameters. Compared: rank 0's
loss and every parameter's merged fp32 gradient. Tolerance (``TOLERANCE``): bf16 rounds each sum
at 2^-8 relative; the plan sums in another order (a row-parallel layer's partial sums rounded to
bf16 before their all-reduce, a split batch's means), so its gradients are as far from the
reference's as bf16 noise allows, not closer. A parameter passes when its gradient is within
``GRAD_REL`` of the reference's norm, or no farther from it than ``NOISE_FACTOR`` times the
reference's own distance from the fp32 gradient (the noise bf16 adds to that parameter), or
within ``GRAD_REL`` of ``FLOOR`` times the whole model's gradient norm: a gradient a thousand
times smaller than the model's is a difference of far larger terms, each rounded at 2^-8 of its
own size (DiffLlama's lambda_q1/k1/q2/k2, the gradient of the scalar weighing its two attention
maps: over five batches the serial bf16 reference itself lands 6-62% from fp32's, the tp=2 plan
14-66%, in the same direction, 1e-5 of the model's gradient norm).

Example:
    >>> model, kwargs = training_model(model, kwargs)
    >>> for mesh_shape, plan in policy_plans(model, kwargs, preset): policy_check(plan, model, kwargs)
"""

from __future__ import annotations

import torch

import autopar as ap
from autopar.runtime.simulator import run_ranks
from autopar.trace.in_dtype import policy_params

BF16 = torch.bfloat16
LOSS_REL = 2e-2  # rank 0's loss against the reference's (measured: under 1e-3 on LLaMA)
GRAD_REL = 3e-2  # a gradient's distance from the reference's, relative to its norm
NOISE_FACTOR = 3.0  # or within this many times bf16's own distance from the fp32 gradient
FLOOR = 1e-3  # or within GRAD_REL of this fraction of the whole model's gradient norm
TOLERANCE = (
    f"loss within {LOSS_REL:g} relative; each parameter's gradient within {GRAD_REL:g} of the reference's norm, "
    f"or within {NOISE_FACTOR:g} x the reference's own distance from fp32's gradient (bf16 noise), or within "
    f"{GRAD_REL:g} x {FLOOR:g} of the model's whole gradient norm (a gradient that small is a difference of far "
    "larger terms)"
)


def with_labels(kwargs: dict) -> dict:
    """The survey's token ids as labels too: the model returns its loss (computed as it trains)."""
    return {**kwargs, "labels": kwargs["input_ids"]}


class NextTokenLoss(torch.nn.Module):
    """A model whose own loss does not run on token ids alone (GitForCausalLM's expects image
    tokens before the text), trained as a user writes the loop: cross-entropy of its logits
    against the next token, in fp32, inside the program (so every plan reduces it)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, **kwargs):
        logits = self.lm(input_ids=input_ids, **kwargs).logits
        return {
            "loss": torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
        }


def training_model(model, kwargs: dict) -> tuple[torch.nn.Module, dict]:
    """(the module the survey trains, its inputs): the model given ``labels=input_ids``, or wrapped
    in NextTokenLoss where its own loss does not run on them."""
    try:
        with torch.no_grad():
            model(**with_labels(kwargs))
        return model, with_labels(kwargs)
    except Exception:  # noqa: BLE001 - the model's loss needs other inputs: the loop computes one
        return NextTokenLoss(model), dict(kwargs)


def policy_plans(model, kwargs: dict, preset: dict | None):
    """(mesh shape, plan) on (2,) and (2, 2), as the module's text says."""
    dp = ap.DataParallel("dp", zero=3, param_dtype=BF16)
    if preset is not None:
        yield (
            (2,),
            ap.plan(
                model,
                ap.Mesh((2,), ("tp",)),
                kwargs=kwargs,
                annotations=dict(preset),
                mixed_precision=ap.MixedPrecision(param_dtype=BF16),
                dynamic=False,
            ),
        )
    else:
        yield (2,), ap.plan(model, ap.Mesh((2,), ("dp",)), kwargs=kwargs, data_parallel=dp, dynamic=False)
    yield (
        (2, 2),
        ap.plan(
            model,
            ap.Mesh((2, 2), ("dp", "tp")),
            kwargs=kwargs,
            annotations=dict(preset or {}),
            data_parallel=dp,
            dynamic=False,
        ),
    )


def _loss(out) -> torch.Tensor:
    return (out.loss if hasattr(out, "loss") else out["loss"]).float()


def serial_reference(model, kwargs: dict, dtype) -> tuple[float, dict]:
    """(loss, fp32 gradients) of ``model`` computing with ``dtype`` copies of its parameters
    (None: in its own dtype)."""
    params = dict(model.named_parameters())
    low = policy_params(model, dtype)  # HF's keep-in-fp32 parameters stay fp32, as the plan keeps them
    loss = _loss(torch.func.functional_call(model, low, (), kwargs))
    trained = {n: p for n, p in params.items() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(trained.values()), allow_unused=True)
    return loss.item(), {n: g for n, g in zip(trained, grads) if g is not None}


def plan_gradients(plan, kwargs: dict) -> tuple[float, dict]:
    """(rank 0's loss, every parameter's merged gradient) of one step of ``plan``'s rank modules."""
    state = {n: p.detach() for n, p in plan.model.named_parameters(remove_duplicate=False)}

    def step(rank):
        module = plan.build_module(rank, state)
        _, local = plan.local_inputs(rank, **kwargs)
        loss = _loss(module(**local))
        loss.backward()
        grads = module.named_parameters(remove_duplicate=False)  # a tied weight under each of its names
        return loss.item(), {n: p.grad for n, p in grads if p.grad is not None}

    results = run_ranks(plan.mesh.size, step)
    return results[0][0], plan.merge_state_dicts([r[1] for r in results])


def policy_check(plan, model, kwargs: dict) -> float:
    """Raise AssertionError naming the loss or the first parameter whose gradient is off (see the
    module's text); return the largest gradient distance relative to the reference's norm."""
    want_loss, want = serial_reference(model, kwargs, BF16)
    _, fp32 = serial_reference(model, kwargs, None)
    got_loss, got = plan_gradients(plan, kwargs)
    if abs(got_loss - want_loss) > LOSS_REL * abs(want_loss):
        raise AssertionError(f"loss {got_loss:.6g} against the bf16 reference's {want_loss:.6g}")
    worst, whole = 0.0, sum(g.norm() ** 2 for g in want.values()).sqrt().item()
    for name, ref in want.items():
        if name not in got:
            raise AssertionError(f"no gradient for {name!r} on the plan's ranks")
        g = got[name]
        if g.dtype != torch.float32:
            raise AssertionError(f"gradient of {name!r} in {g.dtype}: the masters are fp32")
        dist, norm = (g - ref).norm().item(), ref.norm().item()
        noise = (fp32[name] - ref).norm().item() if name in fp32 else 0.0
        worst = max(worst, dist / norm if norm else 0.0)
        if dist > GRAD_REL * max(norm, FLOOR * whole) and dist > NOISE_FACTOR * noise:
            raise AssertionError(
                f"gradient of {name!r} is {dist:.3g} from the bf16 reference's (norm {norm:.3g}, "
                f"bf16's own distance from fp32 {noise:.3g}, the model's gradient norm {whole:.3g})"
            )
    return worst
