"""Device profiles: what a step costs on a kind of machine (alpha, beta per link, FLOP/s, bandwidth).

A collective on a mesh axis costs ``alpha * rounds + bytes / beta`` (ring rounds, see
formulas.ring_steps); compute is a roofline per op (cost/op_time.py). An axis whose ranks all sit
inside one node (the product of its size and the sizes of the axes after it is at most
``ranks_per_node``: ranks are row-major, so the last axis is the innermost) uses the
``intra`` link, any other the ``inter`` link. ``overlap`` is the fraction of the backward
compute that the bucketed gradient sync can hide behind (1.0 on GPUs with their own
communication streams; on a CPU, gloo's threads compete with compute for the same cores).

An op takes the longer of its FLOPs at ``flops_per_s`` (matmuls; attention at
``attention_flops_per_s`` where given) and the bytes its kernels move at ``memory_bandwidth``.
GPU rates are measured (``bench/gpu_calibration.py``; figures in bench/RESULTS.md): on an H100
80GB HBM3 the four matmuls of a LLaMA-3.1-8B decoder layer (bf16, local batch 2 x 8192) ran
forward + backward at 731 TFLOP/s (74% of the 989 TFLOP/s datasheet peak) and its causal flash
attention at 453, counting FLOPs as the cost model does. The bandwidth is what the calibration's
4 GiB copy reached (3.0 TB/s of the datasheet's 3.35: the roof a memory-bound kernel can reach).
The rest of that layer (norms, RoPE, SwiGLU's products, residual adds, casts: 12.4 of its 49.0 ms
measured) the bandwidth term puts at 8.5 ms (tests/unit/test_op_time.py; docs/auto.md). ``h200``
is the same calibration run on a lent H200 (141 GB HBM3e): matmuls 699, attention 452 TFLOP/s,
its copy 4.27 TB/s. The A100 was not measured: ``a100`` takes the H100's share of its 312 TFLOP/s
peak and the H100 copy's share (0.895) of its datasheet bandwidth (A100 80GB SXM, 2.04 TB/s).
Links are derived from published figures: NVLink 4 ~450 GB/s per direction of all-reduce bus
bandwidth, InfiniBand NDR 400 Gb/s ~45 GB/s per GPU; A100: NVLink 3 ~240 GB/s, HDR IB ~22 GB/s.
``cpu-gloo`` is this kind of machine (a few CPU cores, loopback TCP; FLOPs only: its rate is a
measured step's); ``ap.calibrate()`` measures the real one. ``h100-500w`` is the H100 of
torchtitan's published runs (HBM2e, a 500 W power limit): the H100 rates scaled by the
datasheets' power-cap ratio, and the H100 copy's share of its datasheet bandwidth (no constant
fitted to their figures).

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
    flops_per_s: float  # matmul and attention FLOPs per second (the rate a roofline's compute roof is)
    intra: tuple[float, float]  # (alpha s, beta B/s) inside a node
    inter: tuple[float, float]  # between nodes
    ranks_per_node: int = 8
    overlap: float = 1.0  # fraction of backward compute that hides the gradient sync
    memory_bandwidth: float | None = None  # B/s of device memory: memory-bound ops' roof; None: FLOPs only
    attention_flops_per_s: float | None = None  # attention kernels' FLOP/s where they differ from matmuls'
    fp8_ratio: float | None = None  # datasheet dense fp8 / bf16 tensor-core peak; None: no fp8 tensor cores
    # how the rank module runs (ap.Auto(compiled=, float8=) sets them; cost/execution.py and the
    # techniques' op_extras read them)
    compiled: bool | str = False  # under torch.compile ("blocks": each block's): fused regions (cost/fusion.py)
    float8: bool = False  # nn.Linear matmuls (not the LM head) in float8, tensorwise scaling (parallel/float8/cost.py)

    def link(self, mesh, axis: int) -> tuple[float, float]:
        """(alpha, beta) of mesh axis ``axis`` (inner axes first fill a node)."""
        inner = math.prod(mesh.shape[axis:])
        return self.intra if inner <= self.ranks_per_node else self.inter

    def with_values(self, alpha=None, beta=None, flops_per_s=None, memory_bandwidth=None) -> "Profile":
        """The same profile with alpha / beta (both links) / FLOP/s / memory bandwidth replaced where
        given (a FLOP/s given is every op's: attention's own rate is dropped)."""

        def link(lk):
            return (lk[0] if alpha is None else alpha, lk[1] if beta is None else beta)

        return replace(
            self,
            intra=link(self.intra),
            inter=link(self.inter),
            flops_per_s=self.flops_per_s if flops_per_s is None else flops_per_s,
            memory_bandwidth=self.memory_bandwidth if memory_bandwidth is None else memory_bandwidth,
            attention_flops_per_s=self.attention_flops_per_s if flops_per_s is None else None,
        )


# The H100's rates (bench/gpu_calibration_h100.json, 2026-11-27, H100 80GB HBM3, 700 W), at the
# shapes of a LLaMA-3.1-8B layer at local batch 2 x 8192: its four matmuls, 21.44 TFLOP forward +
# backward (6 x 218M params x 16,384 tokens), ran in 29.3 ms at their measured rates: 731 TFLOP/s;
# its causal flash attention, 3.30 TFLOP as op_time counts it (4 x 2 x 32 x 8192^2 x 128 / 2
# forward, backward twice that), in 7.3 ms: 453 TFLOP/s.
H100_MATMUL_FLOPS = 730.8e12
H100_ATTENTION_FLOPS = 452.9e12
H100_DATASHEET_BANDWIDTH = 3.35e12  # HBM3, the H100 SXM datasheet
# What a memory-bound kernel can reach: the same calibration's 4 GiB device-to-device copy
# (read + write bytes over its time), 0.895 of the datasheet's figure. Other cards' datasheet
# bandwidths are taken at that share.
H100_BANDWIDTH = 3.00e12
ACHIEVED_BANDWIDTH_SHARE = H100_BANDWIDTH / H100_DATASHEET_BANDWIDTH

# The H200's rates (bench/gpu_calibration_h200.json, 2026-11-27, a lent H200 141 GB HBM3e), the
# same calibration: the 8B layer's four matmuls at 699 TFLOP/s, its causal flash attention at 452,
# the 4 GiB copy at 4.27 TB/s (its datasheet's 4.8 x 0.89).
H200_MATMUL_FLOPS = 699.1e12
H200_ATTENTION_FLOPS = 451.7e12
H200_BANDWIDTH = 4.27e12

# torchtitan's published H100s (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md):
# 96 GB HBM2e at 2.4 TB/s, the default 500 W power limit, a peak "between SXM and NVL" (their
# footnote). Derived, not fitted to their throughput: the tensor-core rate scales with the peak
# at 500 W, interpolated on power between the datasheets' H100 NVL (400 W, 835 TFLOP/s dense
# bf16) and H100 SXM (700 W, 989): 886 TFLOP/s, 0.896x; the memory-bound ops take the HBM2e's
# 2.4 TB/s at the share the H100's copy reached (2.15 TB/s). Links as ``h100`` (NVLink inside the
# 8-GPU host, 400 Gb/s RDMA per GPU across).
H100_500W_TENSOR = (835e12 + (500 - 400) / (700 - 400) * (989e12 - 835e12)) / 989e12
H100_HBM2E_BANDWIDTH = 2.4e12 * ACHIEVED_BANDWIDTH_SHARE
A100_BANDWIDTH = 2.039e12 * ACHIEVED_BANDWIDTH_SHARE  # A100 80GB SXM datasheet
# Float8 matmuls: the measured bf16 rate times the datasheets' dense fp8 / bf16 peak ratio. H100
# SXM: 1,979 / 989.5 TFLOP/s (the H100 NVL's 1,671 / 835 and the H200's 1,979 / 989 are the same
# 2x). The A100 has no fp8 tensor cores (its datasheet lists none), nor has a CPU: None.
FP8_OVER_BF16 = 1979e12 / 989.5e12


def _gpu(
    name, scale, links, bandwidth, matmul=H100_MATMUL_FLOPS, attention=H100_ATTENTION_FLOPS, fp8=FP8_OVER_BF16
) -> Profile:
    """A GPU profile: measured matmul and attention rates (the H100's by default) times ``scale``."""
    return Profile(name, matmul * scale, *links, 8, 1.0, bandwidth, attention * scale, fp8)


H100_LINKS = ((3e-6, 450e9), (8e-6, 45e9))
PROFILES = {
    "h100": _gpu("h100", 1.0, H100_LINKS, H100_BANDWIDTH),
    "h100-500w": _gpu("h100-500w", H100_500W_TENSOR, H100_LINKS, H100_HBM2E_BANDWIDTH),
    "h200": _gpu("h200", 1.0, H100_LINKS, H200_BANDWIDTH, H200_MATMUL_FLOPS, H200_ATTENTION_FLOPS),
    "a100": _gpu("a100", 312e12 / 989e12, ((4e-6, 240e9), (10e-6, 22e9)), A100_BANDWIDTH, fp8=None),
    "cpu-gloo": Profile("cpu-gloo", 20e9, (60e-6, 1.0e9), (60e-6, 1.0e9), 1 << 30, 0.0),
}
DEFAULT = "h100"


def profile_for(where) -> str:
    """The profile name for a job whose tensors live on ``where`` (a torch.device or None): a
    CPU job is ``cpu-gloo`` (planned for the machine it runs on, not for a GPU it does not
    have); a CUDA device by its name (A100, H200, else H100: the closest measured profile); the
    meta device or None (a shapes-only plan for a cluster) the default, ``h100``."""
    where = torch.device(where) if where is not None else None
    if where is None or where.type == "meta":
        return DEFAULT
    if where.type == "cpu":
        return "cpu-gloo"
    if where.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(where)
        for kind in ("A100", "H200"):
            if kind in name:
                return kind.lower()
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
