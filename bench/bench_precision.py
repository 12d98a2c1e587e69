"""Memory per rank under the bf16 precision policy: autopar against torch FSDP2 with the same policy.

A small HF LLaMA (transformers' LlamaForCausalLM, fp32 weights, eager attention) trains with AdamW on
2 and 4 gloo processes, built twice in the same processes on the same weights and inputs:

- torch FSDP2: ``fully_shard`` on every decoder layer, then on the root, with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
- autopar: ``ap.parallelize(data_parallel=ap.DataParallel("dp", zero=3, param_dtype=bf16,
  reduce_dtype=fp32))``, as a user writes it (the fp32 model planned in bf16 from one trace).

The figure is each one's peak of live tensor bytes in a step after a warm-up step (optimizer state
exists), on top of the parameters and optimizer state (autopar/runtime/live_bytes.py; FSDP2's
unsharded parameters live in storages it resizes outside any op: watched, as bench_fsdp.py does).
Both hold fp32 masters and fp32 AdamW state sharded 1/n; the rest is the bf16 gathered blocks, the
activations (bf16, HF's fp32 upcasts of RMSNorm and the loss) and the gradients' reduce buffers.
Alongside: the first step's loss of each (equal to bf16 rounding: the same recipe).

Example:
    $ PYTHONPATH=. python -m bench.bench_precision --quick
"""

from __future__ import annotations

from bench.bench_fsdp import _peak
from bench.common import main, pool, row

SIZES = {"quick": (2, 64, 256, 32, 2), "full": (4, 256, 1024, 128, 4)}  # layers, hidden, vocab, seq, batch/rank


def _llama(size: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, vocab, seq, _ = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=seq,
        attn_implementation="eager",
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg).train()


def precision_job(size: str) -> dict:
    """Rank's peak live bytes of each contender's step, and each one's first loss."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import autopar as ap

    torch.set_num_threads(1)
    bf16, rank, world = torch.bfloat16, dist.get_rank(), dist.get_world_size()
    _, _, vocab, seq, b = SIZES[size]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b * world, seq), generator=g)
    kw = {"input_ids": ids, "labels": torch.randint(0, vocab, (b * world, seq), generator=g)}
    model = _llama(size)
    theirs = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in theirs.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    dp = ap.DataParallel("dp", zero=3, param_dtype=bf16, reduce_dtype=torch.float32)
    ours = ap.parallelize(copy.deepcopy(model), ap.Mesh((world,), ("dp",)), kwargs=kw, data_parallel=dp)
    _, local = ours.autopar_plan.local_inputs(rank, **kw)
    share = {k: v.chunk(world)[rank] for k, v in kw.items()}
    out = {}
    for name, module, batch in (("fsdp2", theirs, share), ("autopar", ours, local)):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        losses = []

        def step(module=module, batch=batch, opt=opt, losses=losses):
            loss = module(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().float())

        peak = _peak(step, module, opt)
        first = losses[0].clone()
        dist.all_reduce(first)  # FSDP2's rank holds its share's mean; ours the whole batch's
        out[name] = {"peak": peak, "loss": first.item() / world}
    return out


def run(quick: bool) -> list[dict]:
    size = "quick" if quick else "full"
    layers, hidden, _, seq, b = SIZES[size]
    rows = []
    for world in (2, 4):
        res = pool(world).run("bench.bench_precision:precision_job", size)
        worst = max(range(world), key=lambda r: res[r]["autopar"]["peak"] / res[r]["fsdp2"]["peak"])
        pk = {k: v["peak"] for k, v in res[worst].items()}
        loss = {k: v["loss"] for k, v in res[0].items()}
        rows.append(
            row(
                "precision",
                f"HF LLaMA {layers}x{hidden}, seq {seq}, {b} rows/rank, {world} gloo ranks, AdamW, bf16 policy",
                "autopar / FSDP2 peak memory per rank (live bytes, same MixedPrecisionPolicy)",
                round(pk["autopar"] / pk["fsdp2"], 3),
                "<= 1.00",
                f"rank {worst} (the highest ratio): autopar {pk['autopar']}, fsdp2 {pk['fsdp2']}; "
                f"first loss autopar {loss['autopar']:.6f}, fsdp2 {loss['fsdp2']:.6f}",
            )
        )
    return rows


if __name__ == "__main__":
    main(run)
