"""A rank's boxes as something DCP understands, and back.

Plain layouts (Replicate, Shard(d) on each axis) become DTensors on the plan's DeviceMesh
with the same placements. A blocked shard ``Shard(d, blocks=k)`` has no DTensor placement
(DTensor's shards are one contiguous run per rank), and a ZeRO piece is a flat range of the
local tensor: those become Pieces (pieces.py), the rank's boxes each with its true global
offsets, so DCP still records one global tensor under the serial name and reshards it against
any other layout by chunk overlap, and ``full_tensor()`` is the serial tensor.

Example:
    >>> value = to_checkpoint(boxes, shape, spec, device_mesh, rank, world, local)   # a DTensor
    >>> copy_boxes(boxes, loaded_value, "fc1.weight")                  # back into the rank's views
"""

from __future__ import annotations


import torch

from autopar.checkpoint.pieces import Pieces
from autopar.errors import CheckpointError
from autopar.placement import Partial, Shard


def to_checkpoint(boxes, shape, spec, dm, rank: int, world: int, local=None, dtype=None):
    """A DTensor with the plan's placements when ``local`` (the rank's whole tensor) has a DTensor
    layout, else a Pieces (blocked shards, a list's items, ZeRO pieces, pipeline stages, uneven pieces: DTensor
    cuts as torch.chunk, 6 rows on 4 ranks 2,2,2,0, autopar as torch.tensor_split, 2,2,1,1)."""
    # a blocked shard, or an item of a split list (a ModuleList's expert: whole on one rank), is no DTensor layout
    # or a split on a part of an axis (Shard.within / across: replicated over the other part)
    plain = not any(isinstance(p, Shard) and (p.blocks > 1 or p.of is not None or p.grouped) for p in spec)
    if local is not None and plain and not _uneven(shape, spec, dm):
        from torch.distributed.tensor import DTensor

        local = local.detach()
        if local.untyped_storage().nbytes() != local.nbytes:
            # a view into a larger buffer (ZeRO's flat buckets): hand DCP a compact copy, so that
            # async_save's staging copies this tensor, not the bucket (set_state_dict copies back)
            local = local.clone()
        return DTensor.from_local(
            local,
            dm,
            [_dt_placement(p) for p in spec],
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )
    return Pieces.of(boxes, shape, dm, dtype)


def _uneven(shape, spec, dm) -> bool:
    """Whether a split dim of ``shape`` does not divide by its axis of the DeviceMesh ``dm``."""
    sizes = tuple(dm.shape)
    return any(isinstance(p, Shard) and shape[p.dim] % sizes[a] for a, p in enumerate(spec))


def _dt_placement(p):
    from torch.distributed.tensor import Partial as DPartial, Replicate as DReplicate, Shard as DShard

    if isinstance(p, Shard):
        return DShard(p.dim)
    if isinstance(p, Partial):
        return DPartial(p.reduce_op)
    return DReplicate()


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def source_chunks(value) -> list[tuple[tuple, tuple, torch.Tensor]]:
    """(global offsets, sizes, tensor) of what ``value`` holds on this rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, Pieces):
        return value.local_chunks()
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return [(tuple(offsets), tuple(sizes), value.to_local())]
    if isinstance(value, ShardedTensor):
        return [
            (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor) for s in value.local_shards()
        ]
    if isinstance(value, torch.Tensor):
        return [((0,) * value.dim(), tuple(value.shape), value)]
    raise CheckpointError(f"expected a tensor, got {type(value).__name__}")


def copy_boxes(boxes, value, what: str, shape) -> None:
    """Copy each box of this rank from ``value`` (DTensor, ShardedTensor or full tensor)."""
    chunks = source_chunks(value)
    full = getattr(value, "shape", None)
    if full is not None and tuple(full) != tuple(shape):
        raise CheckpointError(
            f"{what}: the state dict holds shape {tuple(full)} but the model's is "
            f"{tuple(shape)}: it was saved for another model or configuration."
        )
    for off, size, view in boxes:
        for coff, csize, ct in chunks:
            if all(c <= o and o + s <= c + n for o, s, c, n in zip(off, size, coff, csize)):
                src = ct
                for d, (o, c, s) in enumerate(zip(off, coff, size)):
                    src = src.narrow(d, o - c, s)
                if src.data_ptr() != view.data_ptr() or src.stride() != view.stride():
                    view.copy_(src)
                break
        else:
            raise CheckpointError(
                f"{what}: the value given does not hold this rank's piece (offsets {off}, sizes {size}); "
                "it is another layout's local piece. Load a checkpoint with dcp.load into the dict "
                "from ap.get_state_dict(module, optimizer) (DCP reshards), or pass full serial tensors."
            )
