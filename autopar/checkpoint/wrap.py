"""A rank's boxes as something DCP understands, and back.

Plain layouts (Replicate, Shard(d) on each axis) become DTensors on the plan's DeviceMesh
with the same placements. A blocked shard ``Shard(d, blocks=k)`` has no DTensor placement
(DTensor's shards are one contiguous run per rank), and a ZeRO piece is a flat range of the
local tensor: those become DTensors whose local tensor carries the rank's boxes (Boxes), each
with its true global offsets, so DCP still records one global tensor under the serial name
and reshards it against any other layout by chunk overlap.

Example:
    >>> value = to_checkpoint(boxes, shape, spec, device_mesh, rank, world, local)   # a DTensor
    >>> copy_boxes(boxes, loaded_value, "fc1.weight")                  # back into the rank's views
"""

from __future__ import annotations


import torch

from autopar.placement import Partial, Shard
from autopar.errors import CheckpointError


def to_checkpoint(boxes, shape, spec, dm, rank: int, world: int, local=None):
    """A DTensor: with the plan's placements when ``local`` (the rank's whole tensor) has a DTensor
    layout, else a boxed one (blocked shards, ZeRO pieces)."""
    if local is not None and not any(isinstance(p, Shard) and p.blocks > 1 for p in spec):
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
    return boxed_dtensor(boxes, shape, dm)


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


class Boxes:
    """Several boxes of one global tensor held in one flat carrier, described to DCP through
    the hooks it consults first (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``, which DTensor forwards to its local tensor). Plain attributes, so
    async_save's staging copies them along with the carrier's storage."""

    def __init__(self, shape, entries):
        self.shape, self.entries = tuple(shape), entries  # [(offsets, sizes, view of the carrier)]

    def write_items(self, fqn, _obj=None):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                    properties=TensorProperties.create_from_tensor(v),
                    size=torch.Size(self.shape),
                ),
            )
            for off, size, v in self.entries
        ]

    def chunk_list(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(off), torch.Size(size)) for off, size, _ in self.entries]

    def tensor_shard(self, index):
        for off, _, v in self.entries:
            if torch.Size(off) == index.offset:
                return v
        raise CheckpointError(f"{index.fqn}: no piece at offset {tuple(index.offset)} on this rank")


class _Hook:
    """One DCP hook of a Boxes (a picklable, deep-copyable callable, unlike a bound method)."""

    def __init__(self, boxes: Boxes, method: str):
        self.boxes, self.method = boxes, method

    def __call__(self, *args):
        return getattr(self.boxes, self.method)(*args)


def boxed_dtensor(boxes, shape, dm):
    """A DTensor (Replicate placements, for the mesh) whose local tensor is a flat carrier of
    the rank's boxes, with the DCP hooks of Boxes: one global tensor under its serial name."""
    from torch.distributed.tensor import DTensor, Replicate as DReplicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    boxes = [b for b in boxes if all(s > 0 for s in b[1])]
    if not boxes:
        return None
    carrier = torch.cat([v.reshape(-1) for _, _, v in boxes])
    entries, at = [], 0
    for off, size, v in boxes:
        entries.append((tuple(off), tuple(size), carrier[at : at + v.numel()].view(size)))
        at += v.numel()
    held = Boxes(shape, entries)
    carrier.__autopar_boxes__ = held
    carrier.__create_write_items__ = _Hook(held, "write_items")
    carrier.__create_chunk_list__ = _Hook(held, "chunk_list")
    carrier.__get_tensor_shard__ = _Hook(held, "tensor_shard")
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), carrier.dtype)
    spec = DTensorSpec(dm, tuple(DReplicate() for _ in range(dm.ndim)), tensor_meta=meta)
    return DTensor(carrier, spec, requires_grad=False)


def source_chunks(value) -> list[tuple[tuple, tuple, torch.Tensor]]:
    """(global offsets, sizes, tensor) of what ``value`` holds on this rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and hasattr(value._local_tensor, "__autopar_boxes__"):
        return list(value._local_tensor.__autopar_boxes__.entries)
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
