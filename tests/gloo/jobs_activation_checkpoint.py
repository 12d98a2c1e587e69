"""gloo jobs for gloo/test_activation_checkpoint.py (each worker runs the job as its rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig
from tests.harness.distributed import merged_parameters, train_beside_serial
from tests.harness.models import MEGATRON, gpt_batch
from tests.harness.serial import max_rel_diff


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1)).train()


def train_matches_serial(mode, steps=2, lr=0.2, offload=False, zero=0):
    """Train the dropout GPT checkpointed (dp x tp, rng='serial'; ``offload``: kept tensors in
    host memory; ``zero``: the dp axis's ZeRO level) and the serial model with the same seeds;
    returns the worst relative parameter difference and the losses."""
    mesh = ap.Mesh((2, 2), ("dp", "tp"))
    module = ap.parallelize(
        _model(),
        mesh,
        args=gpt_batch(),
        annotations=MEGATRON,
        data_parallel=ap.DataParallel("dp", zero=zero),
        rng="serial",
        activation_checkpoint=ap.ActivationCheckpoint(mode, offload=offload),
    )
    assert "checkpoint_blocks_0(" in module.code
    serial = _model()
    losses = train_beside_serial(module, serial, [gpt_batch(seed=step + 10) for step in range(steps)], lr, seeded=True)
    return {"max_rel": max_rel_diff(merged_parameters(module), dict(serial.named_parameters())), "losses": losses}


def pipeline_memory(schedule, checkpoint=False, microbatches=4, chunks=1):
    """A 4-block GPT on 4 pipeline ranks (``chunks`` stages per rank): the bytes this rank holds
    between its actions (LiveBytes: its in-flight micro-batches and the messages it holds), the
    most of them, against the model's ``memory_per_rank(rank)["activations"]``."""
    from tests.harness.models import small_gpt
    from tests.harness.pipeline_memory import held_between_actions

    rank = dist.get_rank()
    batch = gpt_batch(batch=2 * microbatches, seq=16)
    pipe = ap.Pipeline("pp", microbatches=microbatches, schedule=schedule, checkpoint=checkpoint, chunks=chunks)
    plan = ap.plan(small_gpt(layers=4 * chunks), ap.Mesh((4,), ("pp",)), args=batch, pipeline=pipe)
    runner = plan.pipeline_runner(rank)
    held = held_between_actions(runner, batch)
    predicted = plan.memory_per_rank(rank)
    return {
        "held": max(held),
        "model": predicted["activations"],
        "in_flight": runner.stats["max_in_flight"],
        "cost": plan.cost().at()["memory"]["activations"],
        "peak_rank": plan.peak_memory_rank(),
    }
