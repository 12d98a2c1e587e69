"""Bytes per step of zero=3's all-gathers with the float8 weights gathered in fp8 against bf16.

The GPT of bench/models.py ("small": d 128, MLP 512, 2 blocks, vocabulary 512) with fp32 masters
under ``ap.DataParallel("dp", zero=3, param_dtype=bf16)`` and ``ap.Float8("tensorwise", skip=<LM
head>)``, planned twice: gathering in bf16 (``fp8_all_gather=False``) and with the converted Linears'
weights gathered in fp8 (``fp8_all_gather=True``, torchao's ``enable_fsdp_float8_all_gather``). One
simulated training step each under ``ap.comm_stats()``: the bytes rank 0 sends in zero=3's
all-gathers (forward, and again in backward), the whole step's and the fp8 weights' alone, against
the bf16 plan's, and ap.predict's fp8 gather bytes against what ran. Embeddings, norms, biases and
the LM head stay in bf16, so the whole step's ratio lies above the weights' 0.5.

The tensor-parallel rows: the same GPT without biases (torchtitan's Linears) under Megatron's
sequence parallelism on dp2 x tp2 (zero=3, bf16): with ``ap.Float8("tensorwise")`` the
column-parallel Linears' inputs are all-gathered on tp in fp8 and the row-parallel outputs'
gradients too (torchao's Float8ColwiseParallel / Float8RowwiseParallel), against the same plan
without Float8 (bf16 gathers); the fp8 bytes as plan.collectives() lists them against what ran.

Step times are the simulator's on this CPU (every rank in one process, fp8 matmuls emulated by
torch._scaled_mm's CPU path): they say nothing about a GPU, where the gather's bytes are the point.

Example:
    $ OMP_NUM_THREADS=1 python -m bench.run --only float8_gather
"""

from __future__ import annotations

import time

from bench.common import main, row
from bench.models import GPT_TP, build, loss_of

MESHES = {"dp4": ((4,), ("dp",)), "dp2 x tp2": ((2, 2), ("dp", "tp"))}


def _plan(model, args, mesh, fp8):
    import torch

    import autopar as ap
    from autopar.parallel.float8.cost import lm_heads

    shape, axes = MESHES[mesh]
    return ap.plan(
        model,
        ap.Mesh(shape, axes),
        args=args,
        annotations=GPT_TP if "tp" in axes else {},
        data_parallel=ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16),
        float8=ap.Float8("tensorwise", skip=lm_heads(model), fp8_all_gather=fp8),
    )


def _gathers(plan, args) -> tuple[float, float, float]:
    """(all-gather bytes rank 0 sent, of them in fp8, seconds) of one simulated step."""
    import autopar as ap

    dp = {tuple(g) for g in plan.mesh.groups("dp")}
    t0 = time.perf_counter()
    with ap.comm_stats() as stats:
        plan.simulate(lambda m, *a: loss_of(m(*a)).backward(), *args)
    seconds = time.perf_counter() - t0
    recs = [r for r in stats.for_rank(0) if r.kind == "all_gather" and r.group in dp]
    return sum(r.bytes for r in recs), sum(r.bytes for r in recs if r.itemsize == 1), seconds


def _sp_annotations():
    import autopar as ap

    return {
        **GPT_TP,
        "blocks.*.attn.proj": ap.rowwise("tp", output=ap.Shard(1)),
        "blocks.*.mlp.proj": ap.rowwise("tp", output=ap.Shard(1)),
        "blocks.*.ln_*": ap.sequence_parallel("tp"),
        "ln_f": ap.sequence_parallel("tp"),
    }


def _tp_rows(quick: bool) -> list[dict]:
    """fp8 against bf16 bytes of tensor parallel's all-gathers under sequence parallelism."""
    import torch

    import autopar as ap
    from autopar.parallel.float8.cost import lm_heads
    from autopar.models.gpt import GPT, GPTConfig
    from bench.models import SIZES, VOCAB

    d, hidden, layers, heads, batch, seq = SIZES["tiny" if quick else "small"]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=layers, n_head=heads, n_embd=d, mlp_ratio=hidden // d)
    model = GPT(GPTConfig(**{**cfg.__dict__, "bias": False}))
    g = torch.Generator().manual_seed(1)
    args = tuple(torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(2))

    def plan(float8):
        return ap.plan(
            model,
            ap.Mesh((2, 2), ("dp", "tp")),
            args=args,
            annotations=_sp_annotations(),
            data_parallel=ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16),
            float8=ap.Float8("tensorwise", skip=lm_heads(model)) if float8 else None,
        )

    def tp_gathers(p):
        tp = {tuple(g) for g in p.mesh.groups("tp")}
        with ap.comm_stats() as stats:
            p.simulate(lambda m, *a: loss_of(m(*a)).backward(), *args)
        recs = [r for r in stats.for_rank(0) if r.kind == "all_gather" and r.group in tp]
        return sum(r.bytes for r in recs), sum(r.bytes for r in recs if r.itemsize == 1)

    bf16, fp8 = plan(False), plan(True)
    (b_all, _), (f_all, f8_ran) = tp_gathers(bf16), tp_gathers(fp8)
    f8 = torch.ops.autopar.float8_mm.default
    linears = {n.name for n in fp8.graph.nodes if n.target is f8}
    listed = sum(float(c.bytes) for c in fp8.collectives() if c.kind == "all_gather" and c.node in linears)
    same_bf16 = b_all - (f_all - f8_ran)  # the bf16 plan's bytes of the gathers fp8 replaces
    case = f"gpt {'tiny' if quick else 'small'} no bias, dp2 x tp2 + sp, zero=3 bf16"
    return [
        row("float8_gather", case, "tp gather B/step/rank bf16", int(b_all)),
        row("float8_gather", case, "tp gather B/step/rank fp8", int(f_all), note="the Float8 plan, every tp gather"),
        row(
            "float8_gather",
            case,
            "Linear inputs + output grads fp8 / bf16",
            round(f8_ran / same_bf16, 3),
            "0.5",
            f"{int(f8_ran)} B of fp8 against {int(same_bf16)} B of bf16",
        ),
        row("float8_gather", case, "tp fp8 B listed / ran", f"{int(listed)} / {int(f8_ran)}", "equal"),
    ]


def run(quick: bool) -> list[dict]:
    import autopar as ap

    model, args = build("gpt", "tiny" if quick else "small")
    rows = []
    for mesh in MESHES:
        bf16, fp8 = _plan(model, args, mesh, False), _plan(model, args, mesh, True)
        (b_all, _, b_s), (f_all, f8, f_s) = _gathers(bf16, args), _gathers(fp8, args)
        weights_bf16 = b_all - (f_all - f8)  # the same weights' bytes in the bf16 plan (the rest is equal)
        case = f"gpt {'tiny' if quick else 'small'}, {mesh}, zero=3 bf16"
        rows += [
            row("float8_gather", case, "gather B/step/rank bf16", int(b_all)),
            row("float8_gather", case, "gather B/step/rank fp8", int(f_all), note="the fp8 plan, all buckets"),
            row("float8_gather", case, "whole step fp8 / bf16", round(f_all / b_all, 3), "< 1"),
            row(
                "float8_gather",
                case,
                "Linear weights fp8 / bf16",
                round(f8 / weights_bf16, 3),
                "0.5",
                f"{int(f8)} B of fp8 against {int(weights_bf16)} B of bf16",
            ),
            row(
                "float8_gather",
                case,
                "fp8 B predicted / ran",
                f"{int(ap.predict(fp8, 'h100')['fp8_gather_bytes'])} / {int(f8)}",
                "equal",
            ),
            row(
                "float8_gather",
                case,
                "CPU step s bf16 / fp8",
                f"{b_s:.2f} / {f_s:.2f}",
                note="simulated ranks on a CPU: says nothing about a GPU",
            ),
        ]
    return rows + _tp_rows(quick)


if __name__ == "__main__":
    main(run)
