"""Device profiles: what a step costs on a kind of machine (alpha, beta per link, FLOP/s).

A collective on a mesh axis costs ``alpha * rounds + bytes / beta`` (ring rounds, see
formulas.ring_steps); compute costs ``flops / flops_per_s``. An axis whose ranks all sit
inside one node (the product of its size and the sizes of the axes after it is at most
``ranks_per_node``: ranks are row-major, so the last axis is the innermost) uses the
``intra`` link, any other the ``inter`` link. ``overlap`` is the fraction of the backward
compute that the bucketed gradient sync can hide behind (1.0 on GPUs with their own
communication streams; on a CPU, gloo's threads compete with compute for the same cores).

Compute rates are measured (``bench/gpu_calibration.py``; figures in bench/RESULTS.md): on an
H100 80GB HBM3, one LLaMA-3.1-8B decoder layer (bf16, local batch 2 x 8192, HF's ops, flash
SDPA) ran forward + backward at 505 TFLOP/s counting its matmul and attention FLOPs (51% of the
989 TFLOP/s datasheet peak); that rate, which already carries the layer's norms, RoPE and SwiGLU
time, is ``h100``'s ``flops_per_s``. The A100 was not measured: ``a100`` takes the same 51% of its
312 TFLOP/s peak. Links are derived from published figures: NVLink 4 ~450 GB/s per direction
of all-reduce bus bandwidth, InfiniBand NDR 400 Gb/s ~45 GB/s per GPU; A100: NVLink 3 ~240
GB/s, HDR IB ~22 GB/s. ``cpu-gloo`` is this kind of machine (a few CPU cores, loopback TCP);
``ap.calibrate()`` measures the real one. ``h100-500w`` is the H100 of torchtitan's published
runs (HBM2e, a 500 W power limit): its FLOP/s derived from the measured layer below (no
constant fitted to their figures).

Example:
    >>> PROFILES["h100"].link(ap.Mesh((16, 8), ("dp", "tp")), 0)   # (alpha, beta) of InfiniBand
"""

from __future__ import annotations

import torch

import math
from autopar.errors import PlanError
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str
    flops_per_s: float
    intra: tuple[float, float]  # (alpha s, beta B/s) inside a node
    inter: tuple[float, float]  # between nodes
    ranks_per_node: int = 8
    overlap: float = 1.0  # fraction of backward compute that hides the gradient sync

    def link(self, mesh, axis: int) -> tuple[float, float]:
        """(alpha, beta) of mesh axis ``axis`` (inner axes first fill a node)."""
        inner = math.prod(mesh.shape[axis:])
        return self.intra if inner <= self.ranks_per_node else self.inter

    def with_values(self, alpha=None, beta=None, flops_per_s=None) -> "Profile":
        """The same profile with alpha / beta (both links) / FLOP/s replaced where given."""

        def link(lk):
            return (lk[0] if alpha is None else alpha, lk[1] if beta is None else beta)

        return replace(
            self,
            intra=link(self.intra),
            inter=link(self.inter),
            flops_per_s=self.flops_per_s if flops_per_s is None else flops_per_s,
        )


# FLOP/s of a LLaMA-3.1-8B layer's forward + backward on an H100 80GB HBM3 (bench/gpu_calibration.py,
# 2026-11-27: 49.02 ms for 6 x 218M params x 16,384 tokens + causal attention)
H100_LAYER_FLOPS = 505e12

# torchtitan's published H100s (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md):
# 96 GB HBM2e at 2.4 TB/s, the default 500 W power limit, a peak "between SXM and NVL" (their
# footnote). Derived from the measured layer, not fitted to their throughput: the layer's 49.0 ms
# split by the calibration's own rates (bench/gpu_calibration_h100.json) into tensor-core work
# (its four matmuls at their measured rates, 29.3 ms, and flash attention, 7.3 ms: 74.7%) and the
# rest (norms, RoPE, SwiGLU, residual adds: 25.3%, memory-bound). The tensor-core part scales
# with the peak at 500 W, interpolated on power between the datasheets' H100 NVL (400 W, 835
# TFLOP/s dense bf16) and H100 SXM (700 W, 989): 886 TFLOP/s, 0.896x; the rest with the memory
# bandwidth, HBM2e 2.4 TB/s against the SXM's HBM3 3.35 TB/s: 0.716x. The layer then takes
# 0.747 / 0.896 + 0.253 / 0.716 = 1.187x as long: 425 TFLOP/s. Links as ``h100`` (NVLink inside
# the 8-GPU host, 400 Gb/s RDMA per GPU across).
H100_TENSOR_SHARE = 0.747
H100_500W_TENSOR = (835e12 + (500 - 400) / (700 - 400) * (989e12 - 835e12)) / 989e12
H100_HBM2E_BANDWIDTH = 2.4e12 / 3.35e12
H100_500W_LAYER_FLOPS = H100_LAYER_FLOPS / (
    H100_TENSOR_SHARE / H100_500W_TENSOR + (1 - H100_TENSOR_SHARE) / H100_HBM2E_BANDWIDTH
)

PROFILES = {
    "h100": Profile("h100", H100_LAYER_FLOPS, (3e-6, 450e9), (8e-6, 45e9), 8, 1.0),
    "h100-500w": Profile("h100-500w", H100_500W_LAYER_FLOPS, (3e-6, 450e9), (8e-6, 45e9), 8, 1.0),
    "a100": Profile("a100", H100_LAYER_FLOPS / 989e12 * 312e12, (4e-6, 240e9), (10e-6, 22e9), 8, 1.0),
    "cpu-gloo": Profile("cpu-gloo", 20e9, (60e-6, 1.0e9), (60e-6, 1.0e9), 1 << 30, 0.0),
}
DEFAULT = "h100"


def profile_for(where) -> str:
    """The profile name for a job whose tensors live on ``where`` (a torch.device or None): a
    CPU job is ``cpu-gloo`` (planned for the machine it runs on, not for a GPU it does not
    have); a CUDA device by its name (A100, else H100: the closest published profile); the meta
    device or None (a shapes-only plan for a cluster) the default, ``h100``."""
    where = torch.device(where) if where is not None else None
    if where is None or where.type == "meta":
        return DEFAULT
    if where.type == "cpu":
        return "cpu-gloo"
    if where.type == "cuda" and torch.cuda.is_available() and "A100" in torch.cuda.get_device_name(where):
        return "a100"
    return DEFAULT


def profile_of(device, where=None) -> Profile:
    """A Profile from a name ("h100", "a100", "cpu-gloo"), a Profile, or None: the profile of
    the device the job's tensors are on (``where``, see profile_for)."""
    if device is None:
        return PROFILES[profile_for(where)]
    if isinstance(device, Profile):
        return device
    if isinstance(device, str) and device.lower() in PROFILES:
        return PROFILES[device.lower()]
    raise PlanError(
        f"ap.Auto(device={device!r}): use one of {sorted(PROFILES)}, an ap.calibrate() "
        "result, or give alpha=, beta=, flops_per_s= directly."
    )
