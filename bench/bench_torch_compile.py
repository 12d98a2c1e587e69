"""torch.compile of a rank's module: compiled vs eager training step, next to compiled vs eager
serial (the speed-up must survive partitioning, not be lost to graph breaks).

2 gloo processes, GPT-style model, tp=2 with Megatron annotations. Each process times the
rank module eager and compiled (inductor), and the serial model eager and compiled, alternating
(bench/common.py's protocol); the compiled rank module's loss is checked against eager's.
Rows: step time ratio compiled / eager (below 1: compiling helps), and the graph breaks
Dynamo counted in the rank module (target 0).

Example:
    $ python -m bench.run --only torch_compile
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig
from bench.common import alternate, median_ratio, ms, pool, row
from bench.models import GPT_TP

SIZES = {
    "tiny": dict(n_embd=32, n_head=4, n_layer=2, vocab_size=64, block_size=16, batch=4, seq=16),
    "small": dict(n_embd=256, n_head=8, n_layer=4, vocab_size=1024, block_size=128, batch=8, seq=128),
}


def _model(size: str):
    cfg = dict(SIZES[size])
    batch, seq = cfg.pop("batch"), cfg.pop("seq")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g)
    return model, idx, torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g)


def compile_job(size: str, iters: int, warmup: int) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    model, idx, tg = _model(size)
    serial, _, _ = _model(size)
    module = ap.parallelize(model, ap.Mesh((2,), ("tp",)), args=(idx, tg), annotations=GPT_TP)
    compiled, serial_compiled = torch.compile(module), torch.compile(serial)

    def step(fn):
        def go():
            fn(idx, tg)[1].backward()

        return go

    torch._dynamo.utils.counters.clear()
    eager_loss, compiled_loss = module(idx, tg)[1].item(), compiled(idx, tg)[1].item()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())  # the rank module's compile
    steps = {
        "eager": step(module),
        "compiled": step(compiled),
        "serial_eager": step(serial),
        "serial_compiled": step(serial_compiled),
    }
    t = alternate(steps, iters, warmup, barrier=dist.barrier)
    return {"t": t, "loss_diff": abs(eager_loss - compiled_loss), "graph_breaks": breaks}


def run(quick: bool) -> list[dict]:
    size, iters, warmup = ("tiny", 3, 1) if quick else ("small", 20, 3)
    res = pool(2).run("bench.bench_torch_compile:compile_job", size, iters, warmup)[0]
    t = res["t"]
    case = f"gpt {size}, tp=2"
    note = lambda a, b: f"step ms: {a} {ms(t[a]):.2f}, {b} {ms(t[b]):.2f}; n={len(t[a])}"  # noqa: E731
    return [
        row(
            "torch_compile",
            case,
            "rank module compiled / eager",
            round(median_ratio(t["compiled"], t["eager"]), 3),
            "~ serial's ratio",
            note("compiled", "eager") + f"; |loss diff| {res['loss_diff']:.1e}",
        ),
        row(
            "torch_compile",
            "gpt " + size + ", serial",
            "serial compiled / eager",
            round(median_ratio(t["serial_compiled"], t["serial_eager"]), 3),
            "",
            note("serial_compiled", "serial_eager"),
        ),
        row("torch_compile", case, "graph breaks compiling the rank module", res["graph_breaks"], "0", ""),
    ]
