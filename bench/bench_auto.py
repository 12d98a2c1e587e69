"""Automatic planning: the cost model against measured time, auto vs hand plans, search time.

1. **rank correlation**: 14 plans of one GPT on 4 real gloo processes (dp with ZeRO 0/1/2/3, tp,
   tp + sequence parallel, dp x tp, dp x (tp + sp), ZeRO-2 x tp, dp over two axes, HSDP over
   two axes, context parallel by a ring (load balanced), dp x context parallel by all-gathered
   K/V, and the same with ZeRO-3 folded over dp x cp, torchtitan's dp_shard_cp) and 2 of a mixture-of-experts model (HF Mixtral, 8 experts: data parallel with
   every expert on each rank, and expert parallel on dp; pipelines are left out: their step is
   the runner's); each rank calibrates first
   (ap.calibrate: FLOP/s, alpha, beta on this process group), then every plan's step (forward,
   backward, AdamW step) is timed, plans alternating. Spearman's rho between ap.predict's step
   time and the measured median.
2. **auto vs hand** on the HF models of the test suite, mesh (2, 2): ap.predict of the automatic
   plan vs "Megatron preset on one axis, data parallel on the other", both under the same profile;
   then the automatic plan under a budget of half the hand plan's memory per rank.
3. **search time**: LLaMA-3-8B-shaped (HF LlamaConfig sizes on the meta device) on (8, 8) and
   70B on (16, 8): trace + search + emit of every rank's module, in a fresh process (peak RSS).

Example:
    $ PYTHONPATH=. python -m bench.run --only auto
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from bench.common import alternate, main, pool, row

GPT = (2, 256, 8, 1024, 64, 16)  # layers, embd, heads, vocab, seq, global batch
QUICK = (2, 64, 4, 256, 32, 8)


def _plans(cfg):
    import autopar as ap
    from autopar.models.gpt import GPT as Model, GPTConfig
    import torch

    layers, embd, heads, vocab, seq, batch = cfg

    def model():
        torch.manual_seed(0)
        return Model(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=embd))

    g = torch.Generator().manual_seed(0)
    idx, tg = torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
    m4, m22 = ap.Mesh((4,), ("dp",)), ap.Mesh((4,), ("tp",))
    m2x2, mrep = ap.Mesh((2, 2), ("dp", "tp")), ap.Mesh((2, 2), ("rep", "dp"))
    mt = lambda axis, sp=False: ap.presets.megatron(model(), axis, args=(idx, tg), sequence_parallel=sp)  # noqa: E731
    return (
        model,
        (idx, tg),
        {
            "dp": (m4, None, ap.DataParallel("dp")),
            "dp zero1": (m4, None, ap.DataParallel("dp", zero=1)),
            "dp zero2": (m4, None, ap.DataParallel("dp", zero=2)),
            "tp": (m22, mt("tp"), None),
            "tp+sp": (m22, mt("tp", True), None),
            "dp x tp": (m2x2, mt("tp"), ap.DataParallel("dp")),
            "dp x tp+sp": (m2x2, mt("tp", True), ap.DataParallel("dp")),
            "dp zero2 x tp": (m2x2, mt("tp"), ap.DataParallel("dp", zero=2)),
            "dp zero3": (m4, None, ap.DataParallel("dp", zero=3)),
            "dp over 2 axes": (mrep, None, ap.DataParallel("dp", replicate_axis="rep")),
            "hsdp 2x2": (mrep, None, ap.DataParallel("dp", zero=3, replicate_axis="rep")),
            "cp ring": (ap.Mesh((4,), ("cp",)), None, None, ap.ContextParallel("cp", "ring", load_balance=True)),
            "dp x cp": (ap.Mesh((2, 2), ("dp", "cp")), None, ap.DataParallel("dp"), ap.ContextParallel("cp")),
            "dp x cp zero3 folded": (
                ap.Mesh((2, 2), ("dp", "cp")),
                None,
                ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp")),
                ap.ContextParallel("cp"),
            ),
        },
    )


def _moe_plans(cfg):
    """A Mixtral of the GPT's width and depth (8 experts, top-2) on 4 ranks: data parallel with
    every expert local, and expert parallel on dp (2 experts per rank, all-to-all dispatch)."""
    import autopar as ap
    import torch
    import transformers as T

    layers, embd, heads, vocab, seq, batch = cfg

    def model():
        torch.manual_seed(0)
        conf = T.MixtralConfig(
            vocab_size=vocab,
            hidden_size=embd,
            intermediate_size=2 * embd,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=seq,
            use_cache=False,
        )
        return T.MixtralForCausalLM._from_config(conf, attn_implementation="eager")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    kw = {"input_ids": ids, "labels": torch.randint(0, vocab, (batch, seq), generator=g)}
    m4 = ap.Mesh((4,), ("dp",))
    ep = {"model.layers.*.mlp.experts": ap.expert_parallel("dp")}
    return model, kw, {"moe dp": (m4, None, ap.DataParallel("dp")), "moe dp + ep": (m4, ep, ap.DataParallel("dp"))}


def correlation_job(cfg, iters, warmup) -> dict:
    import torch
    import torch.distributed as dist
    import autopar as ap

    torch.set_num_threads(1)
    rank = dist.get_rank()
    prof = ap.calibrate(matmul=256, repeat=5)
    model, args, plans = _plans(cfg)
    moe, moe_kw, moe_plans = _moe_plans(cfg)
    from autopar.runtime.backend import current_backend

    every = [(n, v, model, args, {}) for n, v in plans.items()] + [
        (n, v, moe, (), moe_kw) for n, v in moe_plans.items()
    ]
    steps, predicted, groups = {}, {}, {}
    for name, (mesh, ann, dp, *cp), build, args, kwargs in every:
        static = {"dynamic": False} if kwargs else {}  # the MoE plans: expert dispatch is planned at fixed sizes
        if cp:  # context parallel: every sequence split on its axis
            static["context_parallel"] = cp[0]
        module = ap.parallelize(build(), mesh, args=args, kwargs=kwargs, annotations=ann, data_parallel=dp, **static)
        groups.update(current_backend().groups)  # each compile installs its own; the last must hold all
        plan = module.autopar_plan
        predicted[name] = ap.predict(plan, prof)["time_s"]
        a, kw = plan.local_inputs(rank, *args, **kwargs)
        opt = (
            ap.ZeroOptimizer(module, torch.optim.AdamW, lr=1e-4)
            if dp is not None and dp.zero in (1, 2)
            else torch.optim.AdamW(module.parameters(), lr=1e-4)
        )

        def step(module=module, a=a, kw=kw, opt=opt):
            out = module(*a, **kw)
            loss = out[1] if isinstance(out, tuple) else out["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()

        steps[name] = step
    current_backend().groups.update(groups)
    times = alternate(steps, iters, warmup, barrier=dist.barrier)
    return {
        "predicted": predicted,
        "measured": {n: statistics.median(t) for n, t in times.items()},
        "profile": [prof.flops_per_s, prof.intra[0], prof.intra[1]],
    }


def spearman(a: dict, b: dict) -> float:
    names = list(a)

    def ranks(d):
        order = sorted(names, key=lambda n: d[n])
        return {n: order.index(n) for n in names}

    ra, rb = ranks(a), ranks(b)
    n = len(names)
    return 1 - 6 * sum((ra[x] - rb[x]) ** 2 for x in names) / (n * (n * n - 1))


def auto_vs_hand() -> list[dict]:
    import autopar as ap
    from tests.harness.hf_models import MODELS, inputs, megatron_dp_plan

    rows = []
    for name in sorted(MODELS):
        build = MODELS[name][0]
        model, kw = build(layers=2), inputs(name)
        mesh = ap.Mesh((2, 2), ("a", "b"))
        for device in ("cpu-gloo", "h100"):
            auto = ap.plan(model, mesh, kwargs=kw, auto=ap.Auto(device=device), dynamic=False)
            auto.check(**kw)
            hand = megatron_dp_plan(model, mesh, kw)
            ta, th = ap.predict(auto, device), ap.predict(hand, device)
            rows.append(
                row(
                    "auto",
                    f"{name} x2 on (2,2), {device}",
                    "predicted auto / hand step time",
                    round(ta["time_s"] / th["time_s"], 4),
                    "<= 1",
                    f"auto: {auto.built['auto']['chosen']}; equals serial (plan.check)",
                )
            )
            budget = th["memory"] / 2
            try:
                tight = ap.plan(
                    model, mesh, kwargs=kw, auto=ap.Auto(device=device, memory_budget=budget), dynamic=False
                )
                tight.check(**kw)
                got = ap.predict(tight, device)["memory"]
                rows.append(
                    row(
                        "auto",
                        f"{name} x2 on (2,2), {device}",
                        "memory / budget (half the hand plan's)",
                        round(got / budget, 3),
                        "<= 1",
                        tight.built["auto"]["chosen"],
                    )
                )
            except ap.PlanError as e:
                rows.append(
                    row(
                        "auto",
                        f"{name} x2 on (2,2), {device}",
                        "memory / budget (half the hand plan's)",
                        None,
                        "<= 1",
                        f"no plan fits: {str(e)[:120]}",
                    )
                )
    return rows


SEARCH_SCRIPT = r"""
import json, resource, sys, time, torch, autopar as ap
from transformers import LlamaConfig, LlamaForCausalLM
big = sys.argv[1] == "70b"
cfg = LlamaConfig(vocab_size=128256, hidden_size=8192 if big else 4096, intermediate_size=28672 if big else 14336,
    num_hidden_layers=80 if big else 32, num_attention_heads=64 if big else 32, num_key_value_heads=8,
    max_position_embeddings=8192, attn_implementation="sdpa", tie_word_embeddings=False, use_cache=False)
with torch.device("meta"):
    model = LlamaForCausalLM(cfg)
ids = torch.zeros(16 if big else 8, 2048, dtype=torch.long, device="meta")
mesh = ap.Mesh((16, 8) if big else (8, 8), ("a", "b"))
t0 = time.perf_counter()
plan = ap.plan(model, mesh, kwargs={"input_ids": ids, "labels": ids}, auto=ap.Auto(device="h100"))
t1 = time.perf_counter()
plan.module(0)
t2 = time.perf_counter()
for r in range(1, mesh.size):
    plan.module(r)
t3 = time.perf_counter()
rec = plan.built["auto"]
print(json.dumps({"plan": t1 - t0, "search": rec["search_s"], "emit0": t2 - t1, "emit_all": t3 - t1,
                  "total": t3 - t0, "chosen": rec["chosen"], "nodes": len(plan.graph.nodes),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def search_time(which: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SEARCH_SCRIPT, which],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool) -> list[dict]:
    cfg = QUICK if quick else GPT
    iters, warmup = (5, 1) if quick else (15, 3)
    res = pool(4).run("bench.bench_auto:correlation_job", cfg, iters, warmup)[0]
    rho = spearman(res["predicted"], res["measured"])
    detail = "; ".join(f"{n} {res['predicted'][n] * 1e3:.1f}/{res['measured'][n] * 1e3:.1f}" for n in res["predicted"])
    fps, alpha, beta = res["profile"]
    rows = [
        row(
            "auto",
            f"GPT and Mixtral {cfg[0]}x{cfg[1]}, {len(res['predicted'])} plans, 4 gloo ranks",
            "Spearman rho predicted vs measured",
            round(rho, 3),
            ">= 0.8",
            f"calibrated {fps:.3g} FLOP/s, alpha {alpha:.2g} s, beta {beta:.3g} B/s; ms predicted/measured: {detail}",
        )
    ]
    rows += auto_vs_hand()
    if not quick:
        for which, target, mesh in (("8b", "<= 5 s", "(8,8)"), ("70b", "<= 10 s", "(16,8)")):
            t = search_time(which)
            case = f"LLaMA-3-{which.upper()} shape on meta, {mesh}"
            rows += [
                row(
                    "auto",
                    case,
                    "trace + search + emit all ranks s",
                    round(t["total"], 2),
                    target,
                    f"plan (trace + search) {t['plan']:.2f} s of which search {t['search']:.2f} s; emit rank 0 "
                    f"{t['emit0']:.2f} s, all {t['emit_all']:.2f} s; {t['nodes']} nodes; chose {t['chosen']}",
                ),
                row("auto", case, "peak RSS MiB", round(t["rss_mib"]), "<= 1024", "fresh process"),
            ]
    return rows


if __name__ == "__main__":
    main(run)
