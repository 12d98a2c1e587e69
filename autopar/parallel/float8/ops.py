"""``autopar::float8_mm``: a Linear's matmul (``x @ w.T``) in float8, as torchao's Float8Linear
computes it, on one rank's pieces, with every scale taken from the whole tensor's amax.

torchao scales each cast from an amax (the largest magnitude of the tensor, or of each row or
column for the axiswise recipes). On a rank that holds a piece, the local amax is the piece's;
the serial model's is the max over every piece. So before each cast the local amax is
all-reduced with max over the mesh axes that split the dims it runs over (``masks``), and every
rank then casts with the serial model's scale: its fp8 values are the serial fp8 values of its
piece. The casts and gemms themselves are torchao's own functions (tensor_to_amax,
amax_to_scale, hp_tensor_and_scale_to_float8, its Float8TrainingTensor mm), so nothing of
torchao's numerics is written twice.

The six casts (roles), in torchao's order (float8_linear.py, matmul_with_hp_or_float8_args):
0 input for the output gemm, 1 weight for it, 2 output gradient for grad_input, 3 weight for
grad_input, 4 output gradient for grad_weight, 5 input for grad_weight. ``masks[i]`` has bit r
set when cast r reduces its amax over the i-th group of ranks (``groups`` holds the groups one
after the other, ``sizes[i]`` ranks each). The backward is its own op, so torch.compile and export see both.

Tensor parallel's collectives in fp8 (torchao's Float8ColwiseParallel / Float8RowwiseParallel,
tensorwise): ``float8_gather_input`` casts a rank's piece of the input with the whole input's scale
and all-gathers the fp8 bytes, float8_mm then reads them (``x8``, ``x_scale``) for the output and
grad_weight; with ``scatter`` float8_mm reduce-scatters its output and its backward all-gathers the
output gradient in fp8, cast once for both gemms. The fp8 bytes cross the wire as uint8.

Example:
    >>> y = torch.ops.autopar.float8_mm(x, w, "tensorwise", [], [], [], 0)  # nothing split
    >>> y = torch.ops.autopar.float8_mm(x, w, "tensorwise", [0, 1], [2], [0b111111], 0)
"""

from __future__ import annotations

import torch

from autopar.parallel.float8.recipes import config, torchao_float8
from autopar.runtime.backend import current_backend

ROLES = 6  # the casts of one Linear's forward and backward (module docstring)


def _torchao():
    f8 = torchao_float8()
    from torchao.float8 import config as cfgs, float8_training_tensor as ftt, float8_utils as fu

    return f8, cfgs, ftt, fu


class _Reducer:
    """Each role's amax made the whole tensor's: max over the ranks of every axis its mask names."""

    def __init__(self, groups, sizes, masks, rank):
        self.rank, self.per_axis, start = rank, [], 0
        for size, mask in zip(sizes, masks):
            self.per_axis.append((tuple(groups[start : start + size]), mask))
            start += size

    def __call__(self, amax: torch.Tensor, role: int) -> torch.Tensor:
        for group, mask in self.per_axis:
            if mask >> role & 1:
                amax = current_backend().all_reduce(amax.contiguous(), group, self.rank, "max")
        return amax

    def gather(self, data: torch.Tensor, pairs) -> torch.Tensor:
        """fp8 ``data`` all-gathered on each (axis position, dim) of ``pairs``, as bytes (1 per element)."""
        raw = data.contiguous().view(torch.uint8)
        for pos, dim in _pairs(pairs):
            raw = current_backend().all_gather(raw, dim, self.per_axis[pos][0], self.rank)
        return raw.view(data.dtype)

    def scatter(self, t: torch.Tensor, pairs) -> torch.Tensor:
        """``t`` (a partial sum over the axes of ``pairs``) reduce-scattered on each (position, dim), in
        the reverse order of ``gather`` (its backward)."""
        for pos, dim in reversed(_pairs(pairs)):
            t = current_backend().reduce_scatter(t.contiguous(), dim, self.per_axis[pos][0], self.rank, "sum")
        return t


def _pairs(flat) -> list[tuple[int, int]]:
    """[pos, dim, pos, dim, ...] (a custom op's int list) as pairs."""
    flat = list(flat or ())
    return list(zip(flat[0::2], flat[1::2]))


def _split_shape(shape, pairs, sizes) -> list[int]:
    """``shape`` with each dim of ``pairs`` cut into its axis' number of pieces (a reduce-scatter's output)."""
    out = list(shape)
    for pos, dim in _pairs(pairs):
        out[dim] //= sizes[pos]
    return out


def _gathered_shape(shape, pairs, sizes) -> list[int]:
    out = list(shape)
    for pos, dim in _pairs(pairs):
        out[dim] *= sizes[pos]
    return out


def _cast(t, cast_config, role_kind, axiswise_dim, reduce, role, mm_config, pow2):
    """torchao's hp_tensor_to_float8_dynamic with the amax reduced first (or ``t`` for a disabled cast)."""
    _, cfgs, ftt, fu = _torchao()
    if cast_config.scaling_type is cfgs.ScalingType.DISABLED:
        return t
    gran = cast_config.scaling_granularity
    dim = axiswise_dim if gran is cfgs.ScalingGranularity.AXISWISE else None
    amax = reduce(fu.tensor_to_amax(t, False, None, gran, dim), role)
    scale = fu.amax_to_scale(amax, cast_config.target_dtype, pow2)
    return ftt.hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, mm_config, role_kind, dim)


def _mm_config(c):
    """torchao's LinearMMConfig of a Float8Linear with config ``c`` (Float8Linear.__init__)."""
    _, _, ftt, _ = _torchao()
    gemm = [c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight]
    return ftt.LinearMMConfig(*(ftt.ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in gemm))


def _gathered(w, w8, w_scale, mm):
    """The weight zero=3 gathered in fp8 (gather.py), as torchao's Float8TrainingTensor: ``w`` is its
    stand-in (shape, dtype), ``w8`` its fp8 data, ``w_scale`` the whole weight's scale."""
    _, _, ftt, _ = _torchao()
    return ftt.Float8TrainingTensor(w8, w_scale, w.dtype, mm, ftt.GemmInputRole.WEIGHT)


def _fp8_input(x, x8, x_scale, mm):
    """The input gathered in fp8 (``float8_gather_input``) as torchao's Float8TrainingTensor, rows flattened."""
    _, _, ftt, _ = _torchao()
    return ftt.Float8TrainingTensor(x8.reshape(-1, x8.shape[-1]), x_scale, x.dtype, mm, ftt.GemmInputRole.INPUT)


def _forward(x, w, recipe, reduce, w8=None, w_scale=None, x8=None, x_scale=None, scatter=None):
    _, _, ftt, _ = _torchao()
    c = config(recipe)
    mm, pow2, role = _mm_config(c), c.round_scales_to_power_of_2, ftt.GemmInputRole
    if x8 is None:
        # rows flattened before the cast (torchao casts (..., K) then reshapes: the same rows' amaxes,
        # and its axiswise Float8TrainingTensor cannot be reshaped)
        x8 = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input, role.INPUT, -1, reduce, 0, mm, pow2)
    else:  # cast before tensor parallel's gather, with the whole input's scale (float8_gather_input)
        x8 = _fp8_input(x, x8, x_scale, mm)
    if w8 is None:
        w8 = _cast(w.t(), c.cast_config_weight, role.WEIGHT, 0, reduce, 1, mm, pow2)
    else:  # gathered in fp8 with the whole weight's scale: the values the cast above gives
        w8 = _gathered(w, w8, w_scale, mm).t()
    y = torch.mm(x8, w8)
    # a row-parallel output on a sequence split: the partial sums reduce-scattered in the compute dtype
    return reduce.scatter(y.reshape(*x.shape[:-1], y.shape[-1]), scatter)


def _backward(go, x, w, recipe, reduce, w8=None, w_scale=None, x8=None, x_scale=None, scatter=None):
    _, _, ftt, _ = _torchao()
    c = config(recipe)
    mm, pow2, role = _mm_config(c), c.round_scales_to_power_of_2, ftt.GemmInputRole
    w_t = w.t()
    if scatter:
        # torchao's Float8RowwiseParallel: the output gradient's piece cast to fp8 (its amax over every
        # axis splitting it), then all-gathered in fp8; one cast for both gemms (tensorwise)
        go8 = _cast(go, c.cast_config_grad_output, role.GRAD_OUTPUT, -1, reduce, 2, mm, pow2)
        data = reduce.gather(go8._data, scatter)
        go8 = ftt.Float8TrainingTensor(data.reshape(-1, data.shape[-1]), go8._scale, go.dtype, mm, role.GRAD_OUTPUT)
        go_shape = data.shape
    else:
        go2 = go.reshape(-1, go.shape[-1])
        go8 = _cast(go2, c.cast_config_grad_output, role.GRAD_OUTPUT, -1, reduce, 2, mm, pow2)
        go_shape = go.shape
    if w8 is None:
        wt8 = _cast(w_t, c.cast_config_weight_for_grad_input, role.WEIGHT, -1, reduce, 3, mm, pow2)
    else:  # torchao reuses the fp8 weight gathered for the output (tensorwise: the same cast)
        wt8 = _gathered(w, w8, w_scale, mm).t()
    gx = torch.mm(go8, wt8.t()).reshape(*go_shape[:-1], x.shape[-1])
    if not scatter:
        go8 = _cast(go2, c.cast_config_grad_output_for_grad_weight, role.GRAD_OUTPUT, 0, reduce, 4, mm, pow2)
    if x8 is None:
        x2 = x.reshape(-1, x.shape[-1])
        x8 = _cast(x2, c.cast_config_input_for_grad_weight, role.INPUT, 0, reduce, 5, mm, pow2)
    else:  # torchao reuses the fp8 input it gathered (tensorwise: the same cast)
        x8 = _fp8_input(x, x8, x_scale, mm)
    return gx, torch.mm(go8.t(), x8)


@torch.library.custom_op("autopar::float8_mm", mutates_args=())
def float8_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    recipe: str,
    groups: list[int],
    sizes: list[int],
    masks: list[int],
    rank: int,
    w8: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    x8: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    scatter: list[int] | None = None,
) -> torch.Tensor:
    """``x @ w.T`` in float8 (``w``: a Linear's weight, out x in features; or, with ``w8`` and
    ``w_scale``, the fp8 weight zero=3 gathered and ``w`` its stand-in: gather.py; with ``x8`` and
    ``x_scale``, the input tensor parallel gathered in fp8 and ``x`` its stand-in: float8_gather_input).
    ``scatter``: [position, dim, ...] of the axes (positions in ``sizes``) over which the output is
    reduce-scattered on ``dim`` (a row-parallel Linear on a sequence split: torchao's
    Float8RowwiseParallel, whose backward all-gathers the output gradient in fp8)."""
    reduce = _Reducer(groups, sizes, masks, rank)
    return _forward(x, w, recipe, reduce, w8, w_scale, x8, x_scale, scatter).contiguous()


@float8_mm.register_fake
def _(x, w, recipe, groups, sizes, masks, rank, w8=None, w_scale=None, x8=None, x_scale=None, scatter=None):
    return x.new_empty(_split_shape((*x.shape[:-1], w.shape[0]), scatter, sizes))


@torch.library.custom_op("autopar::float8_mm_backward", mutates_args=())
def float8_mm_backward(
    go: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    recipe: str,
    groups: list[int],
    sizes: list[int],
    masks: list[int],
    rank: int,
    w8: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    x8: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    scatter: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of x, grad of w) of float8_mm, torchao's backward gemms with the amax reduced."""
    reduce = _Reducer(groups, sizes, masks, rank)
    gx, gw = _backward(go, x, w, recipe, reduce, w8, w_scale, x8, x_scale, scatter)
    return gx.contiguous(), gw.to(w.dtype).contiguous()


@float8_mm_backward.register_fake
def _(go, x, w, recipe, groups, sizes, masks, rank, w8=None, w_scale=None, x8=None, x_scale=None, scatter=None):
    return x.new_empty(x.shape), x.new_empty(w.shape, dtype=w.dtype)


def _setup(ctx, inputs, output):
    # the fp8 weight zero=3 gathered (inputs 7, 8) and the fp8 input tensor parallel gathered (9, 10)
    # are saved as they are, as torchao saves them
    ctx.save_for_backward(inputs[0], inputs[1], *inputs[7:11])
    ctx.rest = tuple(list(a) if isinstance(a, (list, tuple)) else a for a in inputs[2:7])
    ctx.scatter = None if inputs[11] is None else list(inputs[11])


def _grad(ctx, go):
    x, w, *gathered = ctx.saved_tensors
    gx, gw = float8_mm_backward(go.contiguous(), x, w, *ctx.rest, *gathered, ctx.scatter)
    return (gx, gw) + (None,) * 10


float8_mm.register_autograd(_grad, setup_context=_setup)


@torch.library.custom_op("autopar::float8_gather_input", mutates_args=())
def float8_gather_input(
    x: torch.Tensor, recipe: str, groups: list[int], sizes: list[int], masks: list[int], rank: int, gather: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tensor parallel's gather of a Linear's input in fp8 (torchao's Float8ColwiseParallel and
    PrepareFloat8ModuleInput): this rank's piece of ``x`` cast to fp8 with the whole input's scale
    (its amax all-reduced, max, over every axis of ``masks`` whose bit 0 is set), then all-gathered
    as fp8 bytes on each [position, dim] of ``gather``. Returns (a stand-in of the gathered input,
    shape and compute dtype, which carries its gradient back: reduce-scattered in the compute dtype;
    the gathered fp8 data; its scale): float8_mm's ``x``, ``x8``, ``x_scale``.

    Example:
        >>> xs, x8, scale = torch.ops.autopar.float8_gather_input(x, "tensorwise", [0, 1], [2], [1], r, [0, 1])
    """
    _, cfgs, ftt, fu = _torchao()
    c = config(recipe)
    cast = c.cast_config_input
    reduce = _Reducer(groups, sizes, masks, rank)
    amax = reduce(fu.tensor_to_amax(x, False, None, cfgs.ScalingGranularity.TENSORWISE, None), 0)
    scale = fu.amax_to_scale(amax, cast.target_dtype, c.round_scales_to_power_of_2)
    piece = ftt.hp_tensor_and_scale_to_float8(x, scale, cast.target_dtype, _mm_config(c), ftt.GemmInputRole.INPUT)
    data = reduce.gather(piece._data, gather)
    return x.new_zeros(()).expand(data.shape), data, piece._scale.clone()


@float8_gather_input.register_fake
def _(x, recipe, groups, sizes, masks, rank, gather):
    shape = _gathered_shape(x.shape, gather, sizes)
    dtype = config(recipe).cast_config_input.target_dtype
    return x.new_empty(()).expand(shape), x.new_empty(shape, dtype=dtype), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("autopar::float8_scatter_grad", mutates_args=())
def float8_scatter_grad(
    g: torch.Tensor, groups: list[int], sizes: list[int], rank: int, gather: list[int]
) -> torch.Tensor:
    """float8_gather_input's backward: the gathered input's gradient (partial over the gather's
    axes) reduce-scattered back to this rank's piece, in the compute dtype (as torchao's)."""
    return _Reducer(groups, sizes, [0] * len(sizes), rank).scatter(g, gather).contiguous()


@float8_scatter_grad.register_fake
def _(g, groups, sizes, rank, gather):
    return g.new_empty(_split_shape(g.shape, gather, sizes))


def _gather_setup(ctx, inputs, output):
    ctx.args = (list(inputs[2]), list(inputs[3]), inputs[5], list(inputs[6]))


def _gather_grad(ctx, g, _g8, _gs):
    return float8_scatter_grad(g.contiguous(), *ctx.args), None, None, None, None, None, None


float8_gather_input.register_autograd(_gather_grad, setup_context=_gather_setup)
