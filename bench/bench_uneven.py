"""Uneven pieces on 4 gloo processes (issue 24, docs/uneven.md): what a size that does not
divide by its axis costs against the nearest size that does.

- ``vocab``: a GPT under the Megatron plan with its vocabulary split on tp=4 (vocab-parallel
  embedding and cross-entropy). A GPT-2-like odd vocabulary (pieces cut as torch.tensor_split
  cuts, the collectives padded and trimmed in the program) against the vocabulary rounded up to
  a multiple of 4 (what Megatron does by padding the embedding: every piece equal). Both rank
  programs hold the same largest piece, so the uneven one should cost about the same.
- ``batch``: data parallel on dp=4, a ragged batch (30 rows: 8, 8, 7, 7, planned with the batch
  sized at run time, means weighted by each rank's rows) against a batch of 32 (8 each).

Per contender: step time (SGD, alternating in a shuffled order, medians), bytes per step and
rank (``Plan.collectives()``), and the first step's loss against the serial model's.

Example:
    $ PYTHONPATH=. python -m bench.bench_uneven --quick
"""

from __future__ import annotations

from bench.common import alternate, main, median_ratio, ms, pool, row

SIZES = {  # name -> (layers, hidden, heads, odd vocabulary, sequence, batch per rank)
    "quick": (1, 64, 4, 1021, 16, 2),
    "full": (2, 128, 4, 8191, 64, 4),
}


def _gpt(size: str, vocab: int):
    import torch

    from autopar.models.gpt import GPT, GPTConfig

    layers, hidden, heads, _, seq, _ = SIZES[size]
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden, tied=True))


def _tokens(vocab: int, rows: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g)


def _megatron(ap) -> dict:
    return {
        "blocks.*.attn.qkv": ap.colwise("tp"),
        "blocks.*.attn.proj": ap.rowwise("tp"),
        "blocks.*.mlp.fc": ap.colwise("tp"),
        "blocks.*.mlp.proj": ap.rowwise("tp"),
        "wte": ap.vocab_parallel("tp"),
        "lm_head": ap.vocab_parallel("tp"),
    }


def _contender(vocab, rows, size, axis, annotations, dynamic):
    """(step, info) of one rank's module for a GPT of ``vocab`` on a batch of ``rows``."""
    import torch
    import torch.distributed as dist

    import autopar as ap

    rank, world = dist.get_rank(), dist.get_world_size()
    seq = SIZES[size][4]
    args = _tokens(vocab, rows, seq)
    model, serial = _gpt(size, vocab), _gpt(size, vocab)
    module = ap.parallelize(
        model,
        ap.Mesh((world,), (axis,)),
        args=args,
        annotations=annotations,
        data_parallel=axis if axis == "dp" else None,
        dynamic=dynamic,
    )
    plan = module.autopar_plan
    local, kw = plan.local_inputs(rank, *args)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step():
        _, loss = module(*local, **kw)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with torch.no_grad():
        _, serial_loss = serial(*args)
    loss = step()
    info = {
        "bytes": sum(c.bytes for c in plan.collectives()),
        "loss_diff": abs(loss.item() - serial_loss.item()) / abs(serial_loss.item()),
        "vocab": vocab,
        "rows": rows,
    }
    return step, info


def uneven_job(size: str, iters: int, warmup: int) -> dict:
    """Runs on every rank: the four contenders planned and timed (two pairs, alternating)."""
    import torch
    import torch.distributed as dist

    import autopar as ap

    torch.set_num_threads(1)
    world = dist.get_world_size()
    odd, b = SIZES[size][3], SIZES[size][5]
    padded = -(-odd // world) * world
    steps, info = {}, {}
    for name, vocab in (("vocab_odd", odd), ("vocab_padded", padded)):
        steps[name], info[name] = _contender(vocab, b * world, size, "tp", _megatron(ap), dynamic=False)
    for name, rows in (("batch_ragged", b * world - 2), ("batch_even", b * world)):
        steps[name], info[name] = _contender(padded, rows, size, "dp", {}, dynamic=True)
    times = {}
    for pair in (("vocab_odd", "vocab_padded"), ("batch_ragged", "batch_even")):
        times.update(alternate({k: steps[k] for k in pair}, iters, warmup, barrier=dist.barrier))
    return {"times": times, "info": info}


def run(quick: bool) -> list[dict]:
    size = "quick" if quick else "full"
    iters, warmup = (6, 2) if quick else (20, 3)
    res = pool(4).run("bench.bench_uneven:uneven_job", size, iters, warmup, timeout=900)[0]
    t, info = res["times"], res["info"]
    layers, hidden, _, odd, seq, b = SIZES[size]
    rows = []
    for a, c, what in (
        (
            "vocab_odd",
            "vocab_padded",
            f"vocab {odd} vs {info['vocab_padded']['vocab']} on tp=4 (Megatron + vocab-parallel)",
        ),
        ("batch_ragged", "batch_even", f"batch {info['batch_ragged']['rows']} vs {info['batch_even']['rows']} on dp=4"),
    ):
        case = f"GPT {layers}x{hidden}, seq {seq}, 4 gloo ranks: {what}"
        rows.append(
            row(
                "uneven",
                case,
                "uneven / even step time",
                round(median_ratio(t[a], t[c]), 3),
                "~1 (same largest piece)",
                f"median step ms: uneven {ms(t[a]):.1f}, even {ms(t[c]):.1f}; n={iters}",
            )
        )
        for k in (a, c):
            rows.append(
                row(
                    "uneven",
                    case,
                    f"{k}: bytes per step and rank",
                    int(info[k]["bytes"]),
                    "",
                    f"first-step loss vs serial: rel. diff {info[k]['loss_diff']:.1e}",
                )
            )
    return rows


if __name__ == "__main__":
    main(run)
