"""HuggingFace weights straight into rank pieces, and rank pieces out to a HF directory.

``load_pretrained`` opens the checkpoint's safetensors files (one, or sharded with
``model.safetensors.index.json``) and, for every tensor, reads only this rank's boxes with
``safe_open(...).get_slice`` into the rank's local tensor: a rank never holds more than its
pieces plus one box. Buffers the checkpoint lacks (rotary ``inv_freq``, position ids) are
computed the way the model computes them (see buffers.py). ``save_pretrained`` gathers one
tensor at a time to the rank that writes it (tensors dealt round-robin, one safetensors
file per rank, rank 0 writes config.json and the index), so no rank holds the whole model.

Example:
    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(config)
    >>> module = ap.parallelize(model, mesh, kwargs=..., annotations=ap.presets.megatron(model, kwargs=...))
    >>> ap.load_pretrained(module, "llama_dir")
    >>> ap.save_pretrained(module, "out_dir")      # transformers' from_pretrained reads it
"""

from __future__ import annotations

import torch.distributed as dist
import json
import os

import torch

from autopar.checkpoint.buffers import missing_buffers
from autopar.checkpoint.target import Target
from autopar.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file path in a HF checkpoint directory."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, SINGLE)
    if not os.path.exists(single):
        raise CheckpointError(
            f"{path} has neither {SINGLE} nor {INDEX}: give a HuggingFace checkpoint "
            "directory (save_pretrained's output) with safetensors weights."
        )
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def load_pretrained(module, path: str, *, buffers: dict | None = None) -> None:
    """Fill this rank's pieces of ``module`` from the HF checkpoint directory ``path``.

    ``buffers`` (optional): serial name -> full tensor for buffers neither in the checkpoint
    nor computable from the model's config."""
    from safetensors import safe_open

    t = Target.of(module)
    files = checkpoint_files(path)
    tied = _tied_sources(t.plan)
    local = _all_local(t)
    absent = [n for n in local if _source(n, files, tied) is None]
    computed = missing_buffers(t.plan.model, [n for n in absent if n not in (buffers or {})])
    computed.update(buffers or {})
    handles = {}
    try:
        with torch.no_grad():
            for fqn, tensor in local.items():
                boxes = t.stored_boxes(fqn, tensor.detach())
                src = _source(fqn, files, tied)
                if src is None:
                    _fill_from_full(boxes, computed, fqn)
                    continue
                if files[src] not in handles:
                    handles[files[src]] = safe_open(files[src], "pt")
                sl = handles[files[src]].get_slice(src)
                for off, size, view in boxes:
                    view.copy_(sl[tuple(slice(o, o + s) for o, s in zip(off, size))])
    finally:
        handles.clear()


def _fill_from_full(boxes, computed, fqn):
    if fqn not in computed:
        raise CheckpointError(
            f"load_pretrained: {fqn!r} is not in the checkpoint and could not be "
            "computed from the model; pass buffers={name: tensor} (the full tensor)."
        )
    full = computed[fqn]
    for off, size, view in boxes:
        src = full
        for d, (o, s) in enumerate(zip(off, size)):
            src = src.narrow(d, o, s)
        view.copy_(src)


def _all_local(t: Target) -> dict:
    """Parameters and every buffer (non-persistent too: they may still be unset)."""
    out = t.module.autopar_tensors(all_buffers=True)
    shapes = set(_serial_names(t.plan))
    return {n: v for n, v in out.items() if n in shapes}


def _serial_names(plan):
    m = plan.model_tensors
    return list(m["params"]) + list(m["buffers"])


def _tied_sources(plan) -> dict[str, list[str]]:
    """Each tied name -> the other names of its tensor (a checkpoint may hold only one)."""
    out = {}
    for names in plan.traced.tied.values():
        for n in names:
            out[n] = [m for m in names if m != n]
    return out


def _source(fqn, files, tied):
    if fqn in files:
        return fqn
    return next((m for m in tied.get(fqn, []) if m in files), None)


# ------------------------------------------------------------------------------------ save
def save_pretrained(module, path: str) -> None:
    """Write a HF directory (config.json + safetensors) that ``from_pretrained`` loads.

    Every rank calls it; each tensor is gathered whole only on the rank that writes it."""
    from safetensors.torch import save_file

    t = Target.of(module)
    if not hasattr(t.module, "named_buffers"):
        raise CheckpointError(
            "save_pretrained takes an emitted rank module; for a pipeline, save with "
            "ap.get_state_dict + dcp.save and convert: autopar convert DCP_DIR HF_DIR --model ..."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    names = _save_names(t)
    files = {n: _file_name(i % world, world) for i, n in enumerate(names)}
    mine = {}
    for i, fqn in enumerate(names):
        full = _gather(t, fqn, i % world)
        if full is not None:
            mine[fqn] = full.contiguous()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    save_file(
        mine, os.path.join(path, files[names[0]] if world == 1 else _file_name(rank, world)), metadata={"format": "pt"}
    )
    if rank == 0:
        _write_meta(t, path, files, world)
    dist.barrier()


def _save_names(t: Target) -> list[str]:
    """Persistent tensors, a tied tensor once (under its first name, as transformers saves it)."""
    seen, out = set(), []
    tied_rest = {m for names in t.plan.traced.tied.values() for m in names[1:]}
    for n in t.tensors:
        if n not in tied_rest and n not in seen:
            seen.add(n)
            out.append(n)
    return out


def _file_name(rank: int, world: int) -> str:
    return SINGLE if world == 1 else f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def _gather(t: Target, fqn: str, dst: int):
    """The whole tensor on rank ``dst`` (None elsewhere), from every rank's piece (zero=3's
    stored pieces differ in size: they travel flattened, padded to the longest)."""
    local = t.tensors[fqn].detach().contiguous()
    shapes = _piece_shapes(t, fqn, local.dtype)
    longest = max(_numel(s) for s in shapes)
    padded = torch.cat([local.reshape(-1), local.new_zeros(longest - local.numel())])
    flats = [torch.empty_like(padded) for _ in shapes] if t.rank == dst else None
    dist.gather(padded, flats, dst=dst)
    if flats is None:
        return None
    pieces = [{fqn: f[: _numel(s)].view(s)} for f, s in zip(flats, shapes)]
    return t.plan.merge_state_dicts(pieces)[fqn]


def _piece_shapes(t: Target, fqn: str, dtype) -> list[tuple]:
    """Every rank's piece shape of ``fqn``, derived from the plan on the meta device."""
    full = torch.empty(t.shape(fqn), dtype=dtype, device="meta")
    return [tuple(t.plan.shard_state_dict({fqn: full}, r)[fqn].shape) for r in t.mesh.ranks()]


def _write_meta(t: Target, path: str, files: dict, world: int) -> None:
    config = getattr(t.plan.model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(path)
    if world > 1:
        shapes = {n: t.shape(n) for n in files}
        total = sum(t.tensors[n].element_size() * _numel(shapes[n]) for n in files)
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": files}, f, indent=1)


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
