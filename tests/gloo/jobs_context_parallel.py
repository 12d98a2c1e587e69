"""gloo jobs for gloo/test_context_parallel.py (each worker runs the job as its rank)."""

from __future__ import annotations


import autopar as ap
from tests.harness.distributed import merged_parameters, train_beside_serial
from tests.harness.llama_like import llama_batch, llama_like
from tests.harness.serial import max_rel_diff

MESHES = {"cp4": ((4,), ("cp",), None), "dp2xcp2": ((2, 2), ("dp", "cp"), "dp")}


def train_matches_serial(method, mesh_name, steps=2, lr=0.2):
    """Train the LLaMA-style model context-parallel over real processes and the serial model on
    the same batches; the worst relative parameter difference and the losses."""
    shape, names, dp = MESHES[mesh_name]
    module = ap.parallelize(
        llama_like(),
        ap.Mesh(shape, names),
        args=llama_batch(batch=4),
        data_parallel=dp,
        context_parallel=ap.ContextParallel("cp", method=method),
    )
    serial = llama_like()
    losses = train_beside_serial(module, serial, [llama_batch(batch=4, seed=step + 10) for step in range(steps)], lr)
    return {"max_rel": max_rel_diff(merged_parameters(module), dict(serial.named_parameters())), "losses": losses}
