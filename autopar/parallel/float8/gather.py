"""zero=3's all-gather of the float8 weights in fp8 (torchao's ``enable_fsdp_float8_all_gather``).

With ``ap.Float8("tensorwise", fp8_all_gather=True)`` under ``ap.DataParallel(zero=3)``, the weights
whose every use is a float8 matmul's weight are gathered as fp8 bytes instead of in the compute
dtype: half the bytes of a bf16 gather, a quarter of an fp32 one. As torchtitan does
(``precompute_float8_dynamic_scale_for_fsdp``), their scales are computed once per forward for all
of them at once: each rank takes the amax of its stored piece of every such weight, one all-reduce
(max) over the ranks holding pieces of them (the shard group and the axes splitting the weights,
tensor parallel's) makes them the whole weights' amaxes, and each rank casts its stored pieces with
the resulting scales before the all-gather. The matmul (ops.py's ``float8_mm`` with ``w8`` and
``w_scale``) uses the gathered fp8 weight as it is, for the output and for grad_input, as torchao
reuses it; its gradient flows back to the gather's reduce-scatter through a one-element
stand-in of the weight's shape and dtype.

Numerics: the cast is elementwise and the scale is the whole weight's, so the gathered fp8 weight is
bit for bit what casting the gathered high-precision weight gives: the plan equals the same plan
gathering in the compute dtype bitwise (tests/simulated/test_float8_gather.py).

Only the tensorwise recipe (one scale per weight): torchao refuses the others too
(``Float8LinearConfig``: "enable_fsdp_float8_all_gather only supports tensorwise").

The scales are recomputed at each forward, not once per optimizer step as torchtitan does: the
weights only change at the step, so the values are the same, and no call after ``opt.step()`` is
needed (the cost is one latency-bound all-reduce of a float32 per weight per forward; a backward
that gathers again reuses the forward's scales).

Example:
    >>> dp = ap.DataParallel("dp", zero=3)
    >>> plan = ap.plan(model, mesh, args=(x,), data_parallel=dp, float8=ap.Float8(fp8_all_gather=True))
    >>> [b.wire for b in plan.built["fsdp_buckets"]]      # Float8Wire(...) for the weights' buckets
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.parallel.float8.recipes import config
from autopar.runtime.backend import current_backend


@dataclass(frozen=True)
class Float8Wire:
    """The fp8 form of a bucket of float8 weights on zero=3's wire (Technique.gather_wire)."""

    recipe: str
    axes: tuple  # mesh axes (indices) over which the amaxes are reduced: the shard group's and tp's

    @property
    def dtype(self) -> torch.dtype:
        return config(self.recipe).cast_config_weight.target_dtype

    def bind(self, plan, runtime) -> "_Bound":
        return _Bound(self, plan.mesh.group(tuple(plan.mesh.axis_names[a] for a in self.axes), runtime.rank), runtime)


class _Bound:
    """One rank's half: its fp8 buckets' scales (once per forward) and their casts."""

    def __init__(self, wire: Float8Wire, group: tuple, runtime):
        self.wire, self.group, self.rt = wire, group, runtime
        self.ks = [k for k in runtime.held if runtime.buckets[k].wire == wire]
        self.scales: dict[int, list[torch.Tensor]] | None = None

    def reset(self) -> None:
        self.scales = None

    def _pieces(self, k: int, flat: torch.Tensor):
        b, pos = self.rt.buckets[k], self.rt.pos
        return [flat[lo:hi] for lo, hi in (b.piece(i, pos) for i in range(len(b.names)))]

    def _precompute(self) -> None:
        """Every fp8 weight's scale from the whole weight's amax: one all-reduce (max) for all."""
        rt, c = self.rt, config(self.wire.recipe)
        amax = []
        for k in self.ks:
            flat = rt.flats[k].to(rt.buckets[k].compute_dtype(rt.param_dtype))  # as the matmul would read it
            for piece in self._pieces(k, flat):
                amax.append(piece.abs().max().float() if piece.numel() else flat.new_zeros((), dtype=torch.float32))
        amax = torch.stack(amax)
        if len(self.group) > 1:
            amax = current_backend().all_reduce(amax, self.group, rt.rank, "max")
        from torchao.float8.float8_utils import amax_to_scale

        scale = amax_to_scale(amax, c.cast_config_weight.target_dtype, c.round_scales_to_power_of_2)
        self.scales, i = {}, 0
        for k in self.ks:
            n = len(rt.buckets[k].names)
            self.scales[k] = [scale[j] for j in range(i, i + n)]
            i += n

    def scales_of(self, k: int) -> list[torch.Tensor]:
        if self.scales is None:
            self._precompute()
        return self.scales[k]

    def pack(self, k: int, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunk (in the compute dtype) cast to fp8, each piece with its weight's scale
        (torchao's cast: ``to_fp8_saturated(x.float() * scale)``); the padding stays zero."""
        from torchao.float8.float8_utils import to_fp8_saturated

        b, dtype = self.rt.buckets[k], self.wire.dtype
        out = torch.zeros(chunk.numel(), dtype=dtype, device=chunk.device)
        for i, scale in enumerate(self.scales_of(k)):
            lo, hi = b.piece(i, self.rt.pos)
            if hi > lo:
                out[lo:hi] = to_fp8_saturated(chunk[lo:hi].to(torch.float32) * scale, dtype)
        return out

    def unpack(self, k: int, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the program reads of bucket k: per weight a one-element stand-in of its shape and
        compute dtype (the gradient's way back to the reduce-scatter), then the fp8 weights, then
        their scales (ops.float8_mm's ``w``, ``w8`` and ``w_scale``)."""
        b, rt = self.rt.buckets[k], self.rt
        dtype = b.compute_dtype(rt.param_dtype)
        stand_ins = [torch.zeros((), dtype=dtype, device=v.device).expand(v.shape) for v in views]
        return [*stand_ins, *views, *self.scales_of(k)]
