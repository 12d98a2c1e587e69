"""gloo jobs for gloo/test_context_parallel.py (each worker runs the job as its rank)."""

from __future__ import annotations

import torch.distributed as dist

import autopar as ap
from tests.harness.distributed import merged_parameters, train_beside_serial
from tests.harness.llama_like import llama_batch, llama_like
from tests.harness.serial import grad_errors, max_rel_diff, serial_step

FOLD = ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp"))  # cp folded into the FSDP group
MESHES = {  # name -> (mesh shape, axes, data parallel, load balanced)
    "cp4": ((4,), ("cp",), None, False),
    "dp2xcp2": ((2, 2), ("dp", "cp"), "dp", False),
    "dp2xcp2_fold": ((2, 2), ("dp", "cp"), FOLD, True),
    "cp4_fold": ((4,), ("cp",), ap.DataParallel(zero=3, shard_axes=("cp",)), True),
    "hybrid": ((2, 2), ("cpr", "cpu"), None, True),  # the method on cpr, Ulysses on cpu
}


def train_matches_serial(method, mesh_name, steps=2, lr=0.2):
    """Train the LLaMA-style model context-parallel over real processes and the serial model on
    the same batches; the worst relative parameter difference and the losses."""
    shape, names, dp, balanced = MESHES[mesh_name]
    module = ap.parallelize(
        llama_like(),
        ap.Mesh(shape, names),
        args=llama_batch(batch=4),
        data_parallel=dp,
        context_parallel=_context_parallel(names, method, balanced),
    )
    serial = llama_like()
    losses = train_beside_serial(module, serial, [llama_batch(batch=4, seed=step + 10) for step in range(steps)], lr)
    return {"max_rel": max_rel_diff(merged_parameters(module), dict(serial.named_parameters())), "losses": losses}


def _context_parallel(names, method, balanced):
    if names == ("cpr", "cpu"):  # hybrid: ``method`` across, Ulysses within
        return ap.ContextParallel(names, method=(method, "ulysses"), load_balance=balanced)
    return ap.ContextParallel("cp", method=method, load_balance=balanced)


def pipeline_matches_serial(method):
    """pp x cp on four processes: the LLaMA-style model in two pipeline stages, each sequence split
    on cp (load balanced), one step of 2 micro-batches; the loss and this rank's gradient errors
    against the serial step."""
    rank = dist.get_rank()
    model, batch = llama_like(), llama_batch(batch=8)
    serial_loss, serial_grads = serial_step(model, batch)
    plan = ap.plan(
        model,
        ap.Mesh((2, 2), ("pp", "cp")),
        args=batch,
        context_parallel=ap.ContextParallel("cp", method=method, load_balance=True),
        pipeline=ap.Pipeline("pp", microbatches=2),
    )
    runner = plan.pipeline_runner(rank)
    loss = runner.step(batch)
    return {"loss": loss.item(), "serial": serial_loss.item(), "errors": grad_errors(plan, rank, runner, serial_grads)}


def view_loss_matches_serial(method, balanced, steps=2, lr=0.2, double=False):
    """nanoGPT's loss (``targets.view(-1)``) on cp=4 over real processes: the worst relative parameter
    difference from serial training and the losses (each rank's sequence piece must be contiguous).
    ``double``: the model in float64, on dp=2 x cp=2 (its attention and loss stay float64)."""
    from tests.harness.models import NanoGPTLoss, gpt_batch

    cp = ap.ContextParallel("cp", method=method, load_balance=balanced)
    model, serial = (NanoGPTLoss().double(), NanoGPTLoss().double()) if double else (NanoGPTLoss(), NanoGPTLoss())
    mesh, dp = (ap.Mesh((2, 2), ("dp", "cp")), "dp") if double else (ap.Mesh((4,), ("cp",)), None)
    module = ap.parallelize(model, mesh, args=gpt_batch(batch=2, seq=16), context_parallel=cp, data_parallel=dp)
    batches = [gpt_batch(batch=2, seq=16, seed=step + 10) for step in range(steps)]
    losses = train_beside_serial(module, serial, batches, lr, loss_of=lambda out: out)
    return {"max_rel": max_rel_diff(merged_parameters(module), dict(serial.named_parameters())), "losses": losses}
