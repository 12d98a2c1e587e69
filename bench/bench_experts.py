"""Expert parallelism on 4 gloo processes: a Mixtral-shaped MoE model trained data parallel,
with its experts three ways (docs/experts.md):

- ``dispatch``: ``ap.expert_parallel("dp")``: each rank holds E/4 experts; the routed token
  rows go to their experts' ranks and back by all-to-all;
- ``expert_split``: the expert weights split on dp by ``ap.place(Shard(0))`` without the
  dispatch (the grouped matmuls split by expert, op by op: what ``expert_parallel("dp")`` planned
  before the dispatch existed): the tokens are gathered over dp around the experts;
- ``replicated``: plain data parallelism, every expert on every rank (each rank runs its own
  tokens through them; the expert gradients all-reduced with the others).
- ``dispatch_b``: the 4 ranks as a (2, 2) mesh ``(a, b)``, the batch over both
  (``DataParallel("b", replicate_axis="a")``), the experts over b only: E/2 experts per rank, the
  all-to-alls inside each pair of b's ranks, the expert gradients all-reduced over a.

Per contender: step time (SGD, the contenders alternating in a shuffled order, medians), bytes
per step and rank (``Plan.collectives()``: forward, backward, gradient sync) and expert weights
held per rank. The first step's losses must agree (the same model, data and global loss).

Example:
    $ PYTHONPATH=. python -m bench.bench_experts --quick
"""

from __future__ import annotations

from bench.common import alternate, main, median_ratio, ms, pool, row

SIZES = {  # name -> (layers, hidden, experts, top-k, expert ffn, seq, batch per rank)
    "quick": (1, 32, 4, 2, 32, 16, 2),
    "full": (2, 128, 8, 2, 256, 64, 4),
}


def _model(size: str):
    import torch
    import transformers as T

    layers, hidden, experts, k, ffn, seq, _ = SIZES[size]
    cfg = T.MixtralConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=k,
        max_position_embeddings=seq,
        use_cache=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return T.MixtralForCausalLM._from_config(cfg, attn_implementation="eager").eval()


def _batch(size: str, world: int) -> dict:
    import torch

    *_, seq, b = SIZES[size]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (b * world, seq), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, 512, (b * world, seq), generator=g)}


def _annotations(kind: str, model) -> dict:
    import autopar as ap

    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    if kind == "dispatch":
        return {"model.layers.*.mlp.experts": ap.expert_parallel("dp")}
    if kind == "dispatch_b":
        return {"model.layers.*.mlp.experts": ap.expert_parallel("b")}
    if kind == "expert_split":
        return {n: ap.place(ap.Shard(0)) for n in experts}
    return {}


def experts_job(size: str, iters: int, warmup: int) -> dict:
    """Runs on every rank: plan and build the four contenders, check their first losses agree,
    time them alternately; rank 0's figures."""
    import torch
    import torch.distributed as dist

    import autopar as ap

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = _batch(size, world)
    steps, info = {}, {}
    for kind in ("dispatch", "expert_split", "replicated", "dispatch_b"):
        model = _model(size)
        sub = kind == "dispatch_b"  # (a, b) = (2, world / 2), experts over b
        module = ap.parallelize(
            model,
            ap.Mesh((2, world // 2), ("a", "b")) if sub else ap.Mesh((world,), ("dp",)),
            kwargs=kw,
            annotations=_annotations(kind, model),
            data_parallel=ap.DataParallel("b", replicate_axis="a") if sub else "dp",
            dynamic=False,
        )
        plan = module.autopar_plan
        _, local = plan.local_inputs(rank, **kw)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)

        def step(module=module, local=local, opt=opt):
            loss = module(**local)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        comms = plan.collectives()
        info[kind] = {
            "bytes": sum(c.bytes for c in comms),
            "dp_gathers": sum(c.kind == "all_gather" for c in comms),
            "all_to_alls": sum(c.kind == "all_to_all" for c in comms),
            "experts_held": sum(p.numel() for n, p in module.named_parameters() if ".experts." in n),
            "loss": step().item(),
        }
        steps[kind] = step
    times = alternate(steps, iters, warmup, barrier=dist.barrier)
    return {"times": times, "info": info}


def _row(case, metric, value, target="", note=""):
    return row("experts", case, metric, value, target, note)


def run(quick: bool) -> list[dict]:
    size = "quick" if quick else "full"
    iters, warmup = (6, 2) if quick else (20, 3)
    res = pool(4).run("bench.bench_experts:experts_job", size, iters, warmup, timeout=900)[0]
    t, info = res["times"], res["info"]
    layers, hidden, experts, k, ffn, seq, b = SIZES[size]
    case = f"Mixtral {layers}x{hidden}, {experts} experts top-{k} ffn {ffn}, 4 gloo ranks, {b}x{seq} tokens per rank"
    losses = [i["loss"] for i in info.values()]
    agree = max(losses) - min(losses)
    rows = []
    for kind in ("expert_split", "replicated", "dispatch_b"):
        rows.append(
            _row(
                case,
                f"dispatch / {kind} step time",
                round(median_ratio(t["dispatch"], t[kind]), 3),
                "< 1" if kind == "expert_split" else "",
                f"median step ms: dispatch {ms(t['dispatch']):.1f}, {kind} {ms(t[kind]):.1f}; n={iters}",
            )
        )
    for kind, i in info.items():
        rows.append(
            _row(
                case,
                f"{kind}: bytes per step and rank",
                int(i["bytes"]),
                "",
                f"{i['all_to_alls']} all-to-alls, {i['dp_gathers']} all-gathers; expert weights held "
                f"{i['experts_held']}; first-step losses agree to {agree:.1e}",
            )
        )
    return rows


if __name__ == "__main__":
    main(run)
