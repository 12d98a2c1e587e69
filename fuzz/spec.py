"""Random small models, annotations and meshes for the property-based fuzzer.

A case is plain data (a JSON-able dict), so that a failure is saved and replayed exactly:

    {"seed": 3, "vocab": 0, "d": 8, "batch": 4, "seq": 4,
     "blocks": [{"kind": "linear", "out": 12}, {"kind": "act", "fn": "gelu"}, ...],
     "mesh": [[2, 2], ["a0", "a1"]], "dp": "a0", "zero": 3, "checkpoint": "selective", "offload": true,
     "cp": ["a1", "ring", true], "fold": true,      (hybrid: [["a0", "a1"], ["ring", "ulysses"], true])
     "annotations": [["b0", "colwise", "a1"], ...]}

A MoE block (fuzz/moe.py) has its own keys; its experts are annotated
``["blocks.2.experts", "expert", [axis, tp]]`` (``ap.expert_parallel(axis, tp=tp)``, ``axis`` a
name or a list of two); ``"dp_replicate": "a0"`` makes the data parallelism two-axis
(``ap.DataParallel(dp, replicate_axis="a0")``).

Example:
    >>> model, args = build_model(case)
    >>> outcome = run_case(case)          # "ok", or "PlanError: ..." -- anything else raises
"""

from __future__ import annotations

import json
import math
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.trace.export import trace

from .moe import MoE

ACTS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}


class Attention(nn.Module):
    """q, k, v from one linear; heads by reshape/transpose; scores by matmul; softmax. ``doc``:
    packed documents of ``doc`` positions each, every one attending only to itself (a mask built
    from global positions, as HF builds one from position ids that restart per document)."""

    def __init__(self, d: int, heads: int, doc: int | None = None):
        super().__init__()
        self.heads, self.doc = heads, doc
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        if self.doc:
            document = torch.arange(t, device=x.device) // self.doc
            keep = document[:, None] == document[None, :]
            att = att.masked_fill(~keep, float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Residual(nn.Module):
    """x + fc2(act(fc1(x)))."""

    def __init__(self, d: int, hidden: int, fn: str, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2, self.fn = nn.Linear(d, hidden), nn.Linear(hidden, d), fn
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return x + self.fc2(self.drop(ACTS[self.fn](self.fc1(x))))


class Act(nn.Module):
    def __init__(self, fn: str, dropout: float = 0.0):
        super().__init__()
        self.fn = fn
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return self.drop(ACTS[self.fn](x))


class Noise(nn.Module):
    """Random ops a model meets (issue 32): noise injection, a bernoulli mask, a Gumbel trick's
    exponential_, a SpecAugment-style uniform_ mask, a Dropout1d; drawn by placement
    (autopar/sharding/lowerings/random_draws.py). ``ops`` picks which (a bit mask)."""

    def __init__(self, ops: int):
        super().__init__()
        self.ops = ops

    def forward(self, x):
        if self.ops & 1:
            x = x + 0.1 * torch.randn_like(x)
        if self.ops & 2:
            x = x * torch.bernoulli(torch.full_like(x, 0.8))
        if self.ops & 4:
            x = x - 0.1 * torch.empty_like(x).exponential_().log()
        if self.ops & 8:
            x = x * (torch.empty_like(x).uniform_() > 0.2)
        if self.ops & 16:
            x = F.dropout1d(x.transpose(1, 2), 0.2, self.training).transpose(1, 2) if x.dim() == 3 else x
        return x


class BatchNorm(nn.Module):
    """BatchNorm1d over the features of (batch, seq, d), made to normalise with the whole
    batch (ap.sync_batch_norm, so it equals serial on any plan); it writes running statistics."""

    def __init__(self, d: int):
        super().__init__()
        self.bn = ap.sync_batch_norm(nn.BatchNorm1d(d))

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class FuzzModel(nn.Module):
    """An optional embedding, then the blocks in order; the output is the last activation."""

    def __init__(self, case: dict):
        super().__init__()
        d = case["d"]
        self.embed = nn.Embedding(case["vocab"], d) if case["vocab"] else None
        blocks = []
        for spec in case["blocks"]:
            blocks.append(_block(spec, d, case.get("dropout", 0.0)))
            if spec["kind"] == "linear":
                d = spec["out"]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def _block(spec: dict, d: int, dropout: float = 0.0) -> nn.Module:
    """One block; ``dropout`` (the case's, for the dropout and eval modes) after activations."""
    kind = spec["kind"]
    if kind == "linear":
        return nn.Linear(d, spec["out"], bias=spec.get("bias", True))
    if kind == "act":
        return Act(spec["fn"], dropout)
    if kind == "norm":
        return nn.LayerNorm(d)
    if kind == "attn":
        return Attention(d, spec["heads"], spec.get("doc"))
    if kind == "residual":
        return Residual(d, spec["hidden"], spec["fn"], dropout)
    if kind == "noise":
        return Noise(spec["ops"])
    if kind == "bn":
        return BatchNorm(d)
    if kind == "moe":
        return MoE(d, spec)
    raise ValueError(kind)


def draws_random(case: dict) -> bool:
    """Whether the case's model draws random numbers in training (noise blocks): it is then
    checked in rng="serial" mode, where the draws equal the serial model's."""
    return any(b["kind"] == "noise" for b in case["blocks"])


def build_model(case: dict):
    """The model (seeded) and its example input for ``case``."""
    torch.manual_seed(case["seed"])
    model = FuzzModel(case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    shape = (case["batch"], case["seq"])
    if case["vocab"]:
        x = torch.randint(0, case["vocab"], shape, generator=g)
    else:
        x = torch.randn(*shape, case["d"], generator=g)
    return model, (x,)


ANNOTATIONS = {"colwise": ap.colwise, "rowwise": ap.rowwise}


def annotations_of(case: dict) -> dict:
    out = {}
    for pattern, kind, axis in case["annotations"]:
        if kind == "replicate":
            out[pattern] = ap.replicated()
        elif kind == "place":
            out[pattern] = ap.place(*[ap.Shard(a) if isinstance(a, int) else ap.Replicate() for a in axis])
        elif kind == "expert":  # [axis (a name, or a list of two), tp axis or None]
            on, tp = axis
            out[pattern] = ap.expert_parallel(tuple(on) if isinstance(on, list) else on, tp=tp)
        else:
            out[pattern] = ANNOTATIONS[kind](axis)
    return out


MODEL_KEYS = ("seed", "vocab", "d", "batch", "seq", "blocks", "dropout")
_TRACED: dict[str, tuple] = {}  # model spec -> (model, args, traced): tracing is the slow part


def _model_and_trace(case: dict, cache: bool):
    key = json.dumps({k: case.get(k) for k in MODEL_KEYS}, sort_keys=True)
    if cache and key in _TRACED:
        return _TRACED[key]
    model, args = build_model(case)
    # the fuzz blocks all differ: the only list of identical blocks is a MoE block's expert ModuleList,
    # whose two-block export (trace/repeat_blocks.py) fails at its third expert: an export wasted
    traced = trace(model, args, repeat_blocks=False)
    if cache:
        if len(_TRACED) >= 32:
            _TRACED.pop(next(iter(_TRACED)))
        _TRACED[key] = (model, args, traced)
    return model, args, traced


def plan_case(case: dict, cache: bool = True, rng: str = "placement"):
    """ap.plan for ``case``; with ``cache`` the model's trace is reused across cases.

    Reusing a trace is sound because propagation rewrites every node's layout and the
    earlier plan is no longer used; only the planner's call to trace is replaced.
    """
    model, args, traced = _model_and_trace(case, cache)
    shape, names = case["mesh"]
    mesh = ap.Mesh(tuple(shape), tuple(names))
    dp = None
    if case["dp"] is not None:
        fold = (case["dp"], case["cp"][0]) if case.get("fold") else None  # cp folded into the shard group
        dp = ap.DataParallel(
            case["dp"], zero=case.get("zero", 0), replicate_axis=case.get("dp_replicate"), shard_axes=fold
        )
    # every block checkpointed (the blocks differ, so by pattern rather than as repeated blocks)
    ac = None
    if case.get("checkpoint"):
        ac = ap.ActivationCheckpoint(case["checkpoint"], pattern="blocks.*", offload=case.get("offload", False))
    cp = ap.ContextParallel(*case["cp"]) if case.get("cp") else None  # [axis, method, load_balance]
    with mock.patch("autopar.planner.trace", lambda *a, **k: traced):
        plan = ap.plan(
            model,
            mesh,
            args=args,
            annotations=annotations_of(case),
            data_parallel=dp,
            rng=rng,
            activation_checkpoint=ac,
            context_parallel=cp,
        )
    return plan, args


def run_case(case: dict) -> str:
    """'ok' when the plan matches serial, 'PlanError ...' when refused; anything else raises."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan, args = plan_case(case, rng="serial" if draws_random(case) else "placement")
    except ap.PlanError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    plan.check(*args, rtol=1e-4, atol=1e-5)
    from .clip_mode import check_clipping
    from .modes import run_modes

    check_clipping(plan, args)  # clipping mode: ap.clip_grad_norm_ against serial
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_modes(case, plan, args)  # compiled, eval, serial-RNG dropout on a subset (fuzz/modes.py)
    return "ok"


def replay_command(path: str) -> str:
    return f"PYTHONPATH=$PWD .venv/bin/python -m fuzz.replay {path}"
