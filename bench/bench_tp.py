"""Tensor-parallel training-step overhead: autopar vs hand-written Megatron, DTensor, torch's tp_transform.

Every contender is built from the same serial model (same weights), runs the same inputs on
the same gloo process group (2 processes), and is timed alternately with the others
(bench.common.alternate). A training step is forward, loss, backward, gradients dropped.
Sanity row: two identical hand-written modules timed against each other must read 1.00.

Example:
    >>> rows = run(quick=True)
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist

import autopar as ap
from bench.common import alternate, median_ratio, ms, pool, row
from bench.megatron import GPT_STYLES, MLP_STYLES, max_grad_error, megatronize
from bench.models import annotations, build, loss_of

TARGETS = {
    ("megatron", "small"): "<= 1.02",
    ("megatron", "large"): "<= 1.02",
    ("megatron", "30m"): "<= 1.02",
    ("dtensor", "small"): "<= 0.50",
    ("dtensor", "large"): "<= 0.88",
}


ITERS = {"small": 100, "large": 60, "30m": 10}  # pairs per case (BENCH_ITERS overrides)
WARMUP = {"30m": 3}


def _styles(kind):
    return GPT_STYLES if kind == "gpt" else MLP_STYLES


def _step(module, args):
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        loss = loss_of(module(*args))
        loss.backward()
        for p in params:
            p.grad = None
        return loss

    return step


def _dtensor(model, world, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {pat: ColwiseParallel() if s == "col" else RowwiseParallel() for pat, s in _styles(kind).items()}
    model = copy.deepcopy(model)
    for m in model.modules():  # the same local-heads fix a hand-written module needs
        if hasattr(m, "n_head") and hasattr(m, "qkv"):
            m.n_head //= world
    return parallelize_module(model, mesh, plan)


def _tp_transform(model, args, rank, world, kind):
    """torch's graph-level TP on the exported program; an error string where it fails."""
    import fnmatch
    from torch.distributed.tensor.experimental._tp_transform import tensor_parallel_transformation
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = copy.deepcopy(model)
    names = [n for n, _ in model.named_modules()]
    strategies = {
        n: ColwiseParallel() if s == "col" else RowwiseParallel()
        for pat, s in _styles(kind).items()
        for n in names
        if fnmatch.fnmatchcase(n, pat)
    }
    try:
        ep = torch.export.export(model, args, strict=False)
        module = tensor_parallel_transformation(ep, rank, world, "cpu", strategies).module()
        loss = loss_of(module(*args))
        loss.backward()
        return module, float(loss.detach())
    except Exception as e:  # noqa: BLE001 - reported in the table, not raised
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def contenders(kind, size, rank, world, only=None):
    """name -> (module, args), plus notes for contenders that could not be built (``only``: the
    autopar and Megatron pair alone, for a profile)."""
    model, args = build(kind, size)
    mesh = ap.Mesh((world,), ("tp",))
    t0 = time.perf_counter()
    out = {"autopar": (ap.parallelize(model, mesh, args=args, annotations=annotations(kind)), args)}
    t1 = time.perf_counter()
    out.update(
        {
            "megatron": (megatronize(model, rank, world, _styles(kind)), args),
            "megatron_copy": (megatronize(model, rank, world, _styles(kind)), args),
        }
    )
    t2 = time.perf_counter()
    if only is not None:
        return out, {}, None
    if size == "30m":  # the peers that set the targets; torch's export-based transform is left out
        out["dtensor"] = (_dtensor(model, world, kind), args)
        notes = {"build_s": f"autopar {t1 - t0:.1f}, megatron x2 {t2 - t1:.1f}", "tp_transform": "not run at 30m"}
        return out, notes, float(loss_of(model(*args)))
    out["dtensor"] = (_dtensor(model, world, kind), args)
    t3 = time.perf_counter()
    notes = {"build_s": f"autopar {t1 - t0:.1f}, megatron x2 {t2 - t1:.1f}, dtensor {t3 - t2:.1f}"}
    tpt, res = _tp_transform(model, args, rank, world, kind)
    notes["build_s"] += f", tp_transform {time.perf_counter() - t3:.1f}"
    if tpt is None:
        notes["tp_transform"] = res
    else:
        out["tp_transform"] = (tpt, args)
    serial = float(loss_of(model(*args)))
    return out, notes, serial


def tp_job(kind: str, size: str, iters: int, warmup: int) -> dict:
    """Runs on every rank of the pool: build every contender, check its loss, time them alternately."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    built, notes, serial = contenders(kind, size, rank, world)
    losses = {n: float(loss_of(m(*a))) for n, (m, a) in built.items()}
    model, args = build(kind, size)
    megatron_error = max_grad_error(model, built["megatron"][0], args, loss_of, rank, world)
    steps = {n: _step(m, a) for n, (m, a) in built.items()}
    times = alternate(steps, iters, warmup, barrier=dist.barrier)
    return {
        "times": times,
        "notes": notes,
        "losses": losses,
        "serial": serial,
        "megatron_error": megatron_error,
        "job_s": time.perf_counter() - t0,
    }


def _rows(kind, size, res) -> list[dict]:
    t, case = res["times"], f"{kind} {size}"
    bad = {n: v for n, v in res["losses"].items() if abs(v - res["serial"]) > 1e-4 * max(1.0, abs(res["serial"]))}
    wrong = f"; LOSS DIFFERS from serial: {bad}" if bad else ""
    rows = [
        row(
            "tp_step",
            case,
            "megatron / megatron (sanity)",
            round(median_ratio(t["megatron_copy"], t["megatron"]), 3),
            "1.00 +- 0.05",
            f"identical modules{wrong}",
        ),
        row(
            "tp_step",
            case,
            "megatron grad error vs serial",
            float(f"{res['megatron_error']:.2g}"),
            "< 1e-4",
            f"max relative difference of the reference's gradients (rank 0); build s: {res['notes']['build_s']}",
        ),
    ]
    for other in ("megatron", "dtensor", "tp_transform"):
        if other not in t:
            rows.append(row("tp_step", case, f"autopar / {other}", None, "", f"{other} fails: {res['notes'][other]}"))
            continue
        rows.append(
            row(
                "tp_step",
                case,
                f"autopar / {other}",
                round(median_ratio(t["autopar"], t[other]), 3),
                TARGETS.get((other, size), ""),
                f"step ms: autopar {ms(t['autopar']):.2f}, {other} {ms(t[other]):.2f}; n={len(t[other])}",
            )
        )
    return rows


def run(quick: bool) -> list[dict]:
    sizes = [s for s in os.environ.get("BENCH_SIZES", "small,large").split(",") if s in ITERS]
    cases = (
        [("gpt", "tiny")] if quick else [(k, s) for s in sizes for k in (("gpt",) if s == "30m" else ("gpt", "mlp"))]
    )
    rows = []
    for kind, size in cases:
        iters, warmup = (3, 1) if quick else (int(os.environ.get("BENCH_ITERS", ITERS[size])), WARMUP.get(size, 5))
        res = pool(2).run("bench.bench_tp:tp_job", kind, size, iters, warmup)[0]
        rows += _rows(kind, size, res)
    return rows
