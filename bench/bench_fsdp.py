"""Fully sharded data parallel: autopar DataParallel(zero=3) against torch FSDP2, and the
memory of a LLaMA-70B-shaped model on a (16, 8) dp x tp mesh.

- Step time: a GPT-style model (autopar.models.gpt) trains with AdamW (forward, backward,
  step) on 2 and 4 gloo processes; torch FSDP2 (``fully_shard`` on every block, then on the
  root) and ``ap.parallelize(data_parallel=ap.DataParallel("dp", zero=3))`` are built in the
  same processes on the same model and inputs and timed alternately (bench/common.py); the
  figure is the median of the per-iteration ratios autopar / FSDP2 (rank 0).
- Peak memory per rank, counted two ways (torch keeps no CPU allocator statistics), both after
  a warm-up step so optimizer state exists, both on top of the parameters and optimizer state:
  1. live tensor bytes (autopar/runtime/live_bytes.py), deterministic. FSDP2 keeps its
     unsharded parameters in storages it resizes outside any op; they are watched, else its
     gathered blocks would not count;
  2. allocator bytes (torch.profiler memory events: every CPU allocation and free, including
     those no op shows, gloo's output-sized scratch of an all-gather in flight among them), the
     median over 15 alternating steps with its range: on gloo when a buffer is freed depends on
     when the asynchronous collectives finish, so single steps of either differ by a block.
- LLaMA-70B-shaped (80 layers, hidden 8192, 64 heads, MLP 4x, vocab 128256, untied) on the
  meta device, (16, 8) dp x tp, Megatron tensor parallel + zero=3 with bf16 compute:
  plan.memory_per_rank(0) plus activations from plan.cost() at batch 1 per dp rank, sequence 2048 (the cost model's upper bound: every op output kept, bf16).

Example:
    $ PYTHONPATH=. python bench/bench_fsdp.py --quick
"""

from __future__ import annotations


import statistics

from bench.common import alternate, main, median_ratio, ms, pool, row, train_step

SIZES = {
    "quick": (2, 64, 4, 256, 32, 4),
    "full": (4, 256, 8, 1024, 64, 4),
}  # layers, embd, heads, vocab, seq, batch/rank


def _model(size, seed=0):
    import torch
    from autopar.models.gpt import GPT, GPTConfig

    layers, embd, heads, vocab, seq, _ = SIZES[size]
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=embd, tied=False))


def _fsdp2(size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist

    model = _model(size)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _resized_storages(module) -> list:
    """The storages FSDP2 resizes outside any op: its parameters' all-gather outputs (which the
    unsharded parameters view); none for a module that FSDP2 does not manage."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    out = []
    for m in module.modules():
        state = _get_module_fsdp_state(m)
        group = state._fsdp_param_group if state is not None else None
        for fp in group.fsdp_params if group is not None else ():
            out.extend(t.untyped_storage() for t in fp.all_gather_outputs)
    return out


def _held_bytes(module, opt) -> int:
    """Parameters (local pieces) and optimizer state: alive before a step and after it."""
    from autopar.runtime.live_bytes import bytes_of

    state = [t.to_local() if hasattr(t, "to_local") else t for s in opt.state.values() for t in s.values()]
    params = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
    return bytes_of(params + state)


def _peak(step, module, opt) -> int:
    """Peak live tensor bytes of one step (after a warm-up step: optimizer state exists)."""
    from autopar.runtime.live_bytes import LiveBytes

    step()
    with LiveBytes(base=_held_bytes(module, opt), watch=_resized_storages(module)) as mem:
        step()
    return mem.peak


ALLOCATOR_STEPS = 15


def _allocator_peaks(contenders: dict, steps: int = ALLOCATOR_STEPS) -> dict[str, list[int]]:
    """Per contender (name -> (step, module, optimizer)), the peak allocator bytes of each of
    ``steps`` steps, the contenders alternating: parameters and optimizer state plus the most
    bytes allocated within the step and alive at once (torch.profiler memory events, every CPU
    allocation and free)."""
    held = {name: _held_bytes(module, opt) for name, (_, module, opt) in contenders.items()}
    out: dict[str, list[int]] = {name: [] for name in contenders}
    for _ in range(steps):
        for name, (step, _, _) in contenders.items():
            out[name].append(held[name] + _step_allocated_peak(step))
    return out


def _step_allocated_peak(step) -> int:
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    live, now, peak = {}, 0, 0
    for e in sorted(events, key=lambda e: e["ts"]):
        e = e["args"]  # a free of a block allocated before the step is not counted
        if e["Bytes"] > 0:
            live[e["Addr"]] = e["Bytes"]
            now += e["Bytes"]
        elif e["Addr"] in live:
            now -= live.pop(e["Addr"])
        peak = max(peak, now)
    return peak


def fsdp_job(size: str, iters: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    import autopar as ap
    from autopar.api import parallelize

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    _, _, _, vocab, seq, b = SIZES[size]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (b * world, seq), generator=g)
    tg = torch.randint(0, vocab, (b * world, seq), generator=g)
    theirs = _fsdp2(size)
    ours = parallelize(
        _model(size), ap.Mesh((world,), ("dp",)), args=(idx, tg), data_parallel=ap.DataParallel("dp", zero=3)
    )
    a_args, a_kw = ours.autopar_plan.local_inputs(rank, idx, tg)
    (s_fsdp, o_fsdp), (s_ap, o_ap) = (
        train_step(theirs, (idx.chunk(world)[rank], tg.chunk(world)[rank]), optimizer=torch.optim.AdamW),
        train_step(ours, a_args, a_kw, optimizer=torch.optim.AdamW),
    )
    peaks = {"fsdp2": _peak(s_fsdp, theirs, o_fsdp), "autopar": _peak(s_ap, ours, o_ap)}
    allocated = _allocator_peaks({"fsdp2": (s_fsdp, theirs, o_fsdp), "autopar": (s_ap, ours, o_ap)})
    times = alternate({"fsdp2": s_fsdp, "autopar": s_ap}, iters, warmup, barrier=dist.barrier)
    return {"times": times, "peaks": peaks, "allocated": allocated}


def llama70b(batch: int = 1, seq: int = 2048) -> dict:
    """Memory per rank (GB) of a LLaMA-70B-shaped model, (16, 8) dp x tp, zero=3, bf16 compute."""
    import torch
    import autopar as ap
    from autopar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=128256, block_size=seq, n_layer=80, n_head=64, n_embd=8192, tied=False, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    ids = torch.zeros(batch * 16, seq, dtype=torch.long, device="meta")
    from bench.models import GPT_TP

    plan = ap.plan(
        model,
        ap.Mesh((16, 8), ("dp", "tp")),
        args=(ids, ids),
        annotations=GPT_TP,
        data_parallel=ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16),
    )
    mem = plan.memory_per_rank(0)
    acts = plan.cost().at()["memory"]["activations"] / 2  # cost counts fp32 outputs; compute is bf16
    keys = ("params", "grads", "optimizer_state", "gathered", "reduce_buffers")
    out = {k: mem[k] / 1e9 for k in keys}
    out["activations"] = acts / 1e9
    out["total"] = sum(out.values())
    return out


def run(quick: bool) -> list[dict]:
    size = "quick" if quick else "full"
    iters, warmup = (10, 2) if quick else (20, 3)
    layers, embd, *_ = SIZES[size]
    rows = []
    for world in (2, 4):
        res = pool(world).run("bench.bench_fsdp:fsdp_job", size, iters, warmup)[0]
        t, pk, al = res["times"], res["peaks"], res["allocated"]
        case = f"GPT {layers}x{embd}, {world} gloo ranks, AdamW"
        note = f"median step ms: fsdp2 {ms(t['fsdp2']):.1f}, autopar {ms(t['autopar']):.1f}; n={iters}"
        rows.append(
            row(
                "fsdp",
                case,
                "autopar / FSDP2 step time",
                round(median_ratio(t["autopar"], t["fsdp2"]), 3),
                "<= 1.00",
                note,
            )
        )
        rows.append(
            row(
                "fsdp",
                case,
                "autopar / FSDP2 peak memory per rank",
                round(pk["autopar"] / pk["fsdp2"], 3),
                "<= 1.00",
                f"peak live tensor bytes: autopar {pk['autopar']}, fsdp2 {pk['fsdp2']}",
            )
        )
        rows.append(
            row(
                "fsdp",
                case,
                f"autopar / FSDP2 peak allocator bytes per rank (medians of {ALLOCATOR_STEPS} steps)",
                round(statistics.median(al["autopar"]) / statistics.median(al["fsdp2"]), 3),
                "<= 1.00",
                "peak allocated, median [min, max]: "
                + ", ".join(f"{k} {statistics.median(v):.0f} [{min(v)}, {max(v)}]" for k, v in al.items()),
            )
        )
    m = llama70b()
    rows.append(
        row(
            "fsdp",
            "LLaMA-70B-shaped, (16, 8) dp x tp, zero=3, bf16, batch 1 per dp rank, seq 2048",
            "memory per rank (GB)",
            round(m["total"], 1),
            "<= 80",
            ", ".join(f"{k} {v:.1f}" for k, v in m.items() if k != "total"),
        )
    )
    return rows


if __name__ == "__main__":
    main(run)
