"""Fourier transforms (``torch.fft``): each transforms some dims and leaves the others alone, so a
split on an untransformed dim stays split; a transformed dim is gathered first (a split of it
would need the butterfly across ranks). fftshift/ifftshift roll the dims they shift.

The dims: ``fft_fft``-like (one dim, default -1), ``fft_fft2``-like (default the last two),
``fft_fftn``-like (``dim`` if given, else the last ``len(s)`` dims, else every dim).

Example:
    >>> fft_rule(op)   # fft_rfft(x (8, 6), dim=-1) -> [R], [S(0) -> S(0)]
"""

from __future__ import annotations

import torch

from autopar.sharding.rules.registry import OpInfo, Strategy, register
from autopar.sharding.rules.views import _moved

aten = torch.ops.aten
ONE = "fft ifft rfft irfft hfft ihfft"
TWO = "fft2 ifft2 rfft2 irfft2 hfft2 ihfft2"
MANY = "fftn ifftn rfftn irfftn hfftn ihfftn"


def transformed_dims(op: OpInfo) -> set[int]:
    ndim = op.tensors[0].ndim
    name = op.op.overloadpacket.__name__.removeprefix("fft_")
    if name in ("fftshift", "ifftshift"):
        dim = op.arg(1, "dim")
    elif name in ONE.split():
        dim = op.arg(2, "dim", -1)
    else:
        dim, s = op.arg(2, "dim"), op.arg(1, "s")
        if dim is None:
            dim = [-2, -1] if name in TWO.split() else (list(range(-len(s), 0)) if s else list(range(ndim)))
    dims = [dim] if isinstance(dim, int) else (range(ndim) if dim is None else dim)
    return {d % ndim for d in dims}


def fft_rule(op: OpInfo) -> list[Strategy]:
    touched = transformed_dims(op)
    return _moved(op, {d: d for d in range(op.tensors[0].ndim) if d not in touched}, partial=False)


register(*[getattr(aten, f"fft_{n}").default for n in f"{ONE} {TWO} {MANY} fftshift ifftshift".split()])(fft_rule)
