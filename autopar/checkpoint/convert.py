"""Offline conversion, outside a distributed job: full serial state (model and optimizer)
to a plan's per-rank pieces and back, and a DCP checkpoint to a HuggingFace directory.

Optimizer state is keyed by serial parameter name (``{"state": {name: {"exp_avg": ...}},
"param_groups": [...]}``, the layout ap.get_state_dict uses), so it does not depend on the
order in which an optimizer was given its parameters. A state tensor shaped like its
parameter is sharded like it; anything else (``step``) is the same on every rank.

Example:
    >>> full = named_optimizer_state(model, opt)                    # serial model + optimizer
    >>> pieces = [shard_full_state(plan, r, model.state_dict(), full) for r in plan.mesh.ranks()]
    >>> sd, optim = merge_full_states(plan, [p[0] for p in pieces], [p[1] for p in pieces])
    >>> dcp_to_hf("ckpt/step100", "hf_out", model)                  # autopar convert ...
"""

from __future__ import annotations

import os
import torch

from autopar.errors import CheckpointError


def named_optimizer_state(module: torch.nn.Module, optimizer) -> dict:
    """``optimizer``'s state keyed by ``module``'s parameter names (serial or one rank's)."""
    names = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    state = {}
    for p, s in optimizer.state.items():
        if id(p) not in names:
            raise CheckpointError(
                "named_optimizer_state: the optimizer steps a tensor that is not a parameter "
                "of the module (a ZeroOptimizer's flat pieces: use ap.get_state_dict)."
            )
        state[names[id(p)]] = dict(s)
    groups = [
        dict(
            {k: v for k, v in g.items() if k != "params"}, params=[names[id(p)] for p in g["params"] if id(p) in names]
        )
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def _elementwise(v, shape) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(shape)


def shard_full_state(plan, rank: int, model_sd: dict, optim_sd: dict | None = None) -> tuple[dict, dict | None]:
    """``rank``'s pieces of a full serial model state dict and name-keyed optimizer state."""
    pieces = plan.shard_state_dict(model_sd, rank)
    if optim_sd is None:
        return pieces, None
    shapes = {n: tuple(v.shape) for n, v in model_sd.items()}
    state = {}
    for name, s in optim_sd["state"].items():  # laid out (and stored: zero=3) as its parameter
        state[name] = {
            k: plan.shard_state_dict({name: v}, rank)[name].clone() if _elementwise(v, shapes.get(name, ())) else v
            for k, v in s.items()
        }
    return pieces, {"state": state, "param_groups": optim_sd["param_groups"]}


def merge_full_states(plan, model_pieces: list[dict], optim_pieces: list[dict] | None = None):
    """Full serial model state and name-keyed optimizer state from every rank's pieces."""
    full = plan.merge_state_dicts(model_pieces)
    if optim_pieces is None:
        return full, None
    state = {}
    for name, s in optim_pieces[0]["state"].items():
        local_shape = tuple(plan.shard_state_dict({name: full[name]}, 0)[name].shape) if name in full else ()
        state[name] = {
            k: plan.merge_state_dicts([{name: o["state"][name][k]} for o in optim_pieces])[name]
            if _elementwise(v, local_shape)
            else v
            for k, v in s.items()
        }
    return full, {"state": state, "param_groups": optim_pieces[0]["param_groups"]}


def dcp_to_hf(dcp_dir: str, hf_dir: str, model: torch.nn.Module, key: str | None = None) -> list[str]:
    """Read the model's tensors from a DCP checkpoint (any plan, mesh or world size) into the
    serial ``model`` and write a HuggingFace directory (``save_pretrained`` when the model has
    it, else model.safetensors). ``key``: the prefix the model's dict was saved under
    ("model" for ``dcp.save({"model": model_sd, ...})``; found from the checkpoint if None).
    Returns the names loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved = set(FileSystemReader(dcp_dir).read_metadata().state_dict_metadata)
    sd = model.state_dict()
    if key is None:
        key = "" if set(sd) <= saved else "model"
    wrapped = {key: sd} if key else sd
    missing = [k for k in sd if (f"{key}.{k}" if key else k) not in saved]
    if missing:
        raise CheckpointError(
            f"{dcp_dir} lacks {missing[:5]} for {type(model).__name__} (prefix {key!r}): "
            "give the model it was saved from, or --key for the prefix it was saved under."
        )
    dcp.load(wrapped, checkpoint_id=dcp_dir, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    model.load_state_dict(sd)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(hf_dir)
    else:
        from safetensors.torch import save_file

        os.makedirs(hf_dir, exist_ok=True)
        seen, out = set(), {}
        for k, v in sd.items():  # tied weights: safetensors refuses shared storage, so copy the second
            out[k] = v.contiguous() if v.data_ptr() not in seen else v.clone()
            seen.add(v.data_ptr())
        save_file(out, os.path.join(hf_dir, "model.safetensors"))
    return sorted(sd)
