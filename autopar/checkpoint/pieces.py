"""Pieces: a rank's boxes of one global tensor, where no DTensor placement describes them.

A blocked shard ``Shard(d, blocks=k)`` (rank c holds chunk c of each of k blocks), a ZeRO
slice or a zero=3 piece (a contiguous 1-D range of the flattened local tensor), an empty
piece, and every tensor of a pipeline rank (which holds its stages' tensors only): no
``Replicate``/``Shard`` placement says what the rank holds. ``ap.get_state_dict`` gives these
as ``Pieces``, a DTensor subclass that says what it is:

- ``v.shape``, ``v.dtype``: the global (serial) tensor's;
- ``v.full_tensor()``: the serial tensor, on every rank (a collective over the job: call it
  on every rank, for the same keys in the same order; every rank holds every key);
- ``v.local_chunks()``: [(global offsets, sizes, tensor)] of what this rank holds (maybe none);
- ``v.placements``: ``(Boxes(),)`` per mesh axis: not a DTensor layout, so ``v.to_local()`` and
  arithmetic raise ap.CheckpointError (use full_tensor() or local_chunks());
- DCP writes and reads the boxes (``__create_write_items__``, ``__create_chunk_list__``,
  ``__get_tensor_shard__``): one global tensor under the serial name, resharded against any
  layout; ``dcp.async_save``'s staging copies it (``__deepcopy__`` keeps the boxes).

The boxes are kept as integers (offsets, sizes, start in the flat local tensor) and their
views are made from ``_local_tensor`` when asked, so a staged copy that replaced the local
tensor (torch's CPU staging does) describes its own data.

Example:
    >>> model_sd, _ = ap.get_state_dict(module)              # zero=3: Pieces
    >>> full = {k: v.full_tensor() for k, v in model_sd.items()}   # the serial state dict
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from autopar.errors import CheckpointError

# the ops a staged copy or a detach may run on a Pieces: their result is Pieces again
_KEPT = {torch.ops.aten.detach.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default}


class Boxes(Placement):
    """The placement of a Pieces on every mesh axis: boxes of the global tensor, not a layout."""

    def __repr__(self) -> str:
        return "Boxes()"

    def __eq__(self, other) -> bool:
        return isinstance(other, Boxes)

    def __hash__(self) -> int:
        return hash("autopar.Boxes")


class Pieces(DTensor):
    """See the module docstring."""

    _autopar_boxes: list  # [(global offsets, sizes, start in the flat local tensor)]

    @staticmethod
    def of(boxes, shape, dm, dtype=None) -> "Pieces":
        """``boxes`` [(global offsets, sizes, view)] of a global ``shape`` as one Pieces (the
        views copied end to end into one flat local tensor)."""
        boxes = [b for b in boxes if all(s > 0 for s in b[1])]
        if boxes:
            flat = torch.cat([v.reshape(-1) for _, _, v in boxes])
        else:
            flat = torch.empty(0, dtype=dtype or torch.get_default_dtype())
        meta, at = [], 0
        for off, size, v in boxes:
            meta.append((tuple(off), tuple(size), at))
            at += v.numel()
        return Pieces._wrap(flat, meta, shape, dm)

    @staticmethod
    def _wrap(flat, meta, shape, dm) -> "Pieces":
        stride = _contiguous_stride(shape)
        spec = DTensorSpec(dm, (Replicate(),) * dm.ndim, tensor_meta=TensorMeta(torch.Size(shape), stride, flat.dtype))
        out = Pieces(flat, spec, requires_grad=False)
        out._autopar_boxes = list(meta)
        return out

    # ------------------------------------------------------------------ what it holds
    def local_chunks(self) -> list[tuple[tuple, tuple, torch.Tensor]]:
        """(global offsets, sizes, tensor) of each box this rank holds."""
        flat = self._local_tensor.reshape(-1)
        return [(off, size, flat[at : at + _numel(size)].view(size)) for off, size, at in self._autopar_boxes]

    @property
    def placements(self) -> tuple:
        return (Boxes(),) * self._spec.mesh.ndim

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The global tensor on every rank: every rank's boxes gathered (a collective)."""
        import torch.distributed as dist

        mine = ([(off, size) for off, size, _ in self._autopar_boxes], self._local_tensor.detach().cpu())
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        everyone = []
        for boxes, flat in gathered:
            starts = [0]
            for _, size in boxes:
                starts.append(starts[-1] + _numel(size))
            everyone.append(
                [(off, size, flat[a : a + _numel(size)].view(size)) for (off, size), a in zip(boxes, starts)]
            )
        return assemble(self.shape, self.dtype, everyone).to(self._local_tensor.device)

    def to_local(self, *, grad_placements=None):
        raise CheckpointError(
            "This value is a rank's boxes of a global tensor (autopar.checkpoint.Pieces: a blocked "
            "shard, a ZeRO piece, a pipeline stage's), which no DTensor layout describes: use "
            ".full_tensor() (on every rank) for the serial tensor or .local_chunks() for this rank's boxes."
        )

    def __repr__(self) -> str:
        boxes = ", ".join(f"{off}+{size}" for off, size, _ in self._autopar_boxes) or "none"
        return f"Pieces(shape={tuple(self.shape)}, dtype={self.dtype}, boxes on this rank: {boxes})"

    # ------------------------------------------------------------------ DCP's hooks
    def __create_write_items__(self, fqn: str, object):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                    properties=TensorProperties.create_from_tensor(v),
                    size=self.shape,
                ),
            )
            for off, size, v in self.local_chunks()
        ]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(off), torch.Size(size)) for off, size, _ in self._autopar_boxes]

    def __get_tensor_shard__(self, index):
        for off, _, v in self.local_chunks():
            if torch.Size(off) == index.offset:
                return v
        raise CheckpointError(f"{index.fqn}: no piece at offset {tuple(index.offset)} on this rank")

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo):
        return Pieces._wrap(copy.deepcopy(self._local_tensor, memo), self._autopar_boxes, self.shape, self._spec.mesh)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _KEPT and isinstance(args[0], Pieces):
            src = args[0]
            local = func(src._local_tensor, *args[1:], **(kwargs or {}))
            return Pieces._wrap(local, src._autopar_boxes, src.shape, src._spec.mesh)
        if func is torch.ops.aten.new_empty.default and isinstance(args[0], Pieces):
            # DCP's stager makes the copy's shell so, then sets its attributes (boxes, local tensor)
            src = args[0]
            return Pieces._wrap(src._local_tensor.new_empty([0], **(kwargs or {})), [], src.shape, src._spec.mesh)
        raise CheckpointError(
            f"{func} on an autopar.checkpoint.Pieces (a rank's boxes of a global tensor, not a DTensor "
            "layout): take .full_tensor() (on every rank) or .local_chunks() first."
        )


def assemble(shape, dtype, everyone: list) -> torch.Tensor:
    """The global tensor from every rank's boxes [(global offsets, sizes, tensor)] (replicated
    boxes overlap with equal values); a region no rank holds is an error, not garbage."""
    full = torch.empty(shape, dtype=dtype)
    filled = torch.zeros(shape, dtype=torch.bool)
    for boxes in everyone:
        for off, size, v in boxes:
            region = tuple(slice(o, o + n) for o, n in zip(off, size))
            full[region] = v.reshape(size)
            filled[region] = True
    if not bool(filled.all()):
        raise CheckpointError(
            f"full_tensor(): the ranks' pieces cover {int(filled.sum())} of {filled.numel()} elements of "
            "this tensor; it was not made by ap.get_state_dict on every rank of one job."
        )
    return full


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _numel(size) -> int:
    out = 1
    for s in size:
        out *= s
    return out
