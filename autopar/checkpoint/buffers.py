"""Buffers a checkpoint lacks (rotary ``inv_freq``, position ids), computed as the model does.

Such buffers are made by the constructor of the module that owns them, from its config. On
a meta-device model they hold no values, so they are recomputed by running that owner's
constructor again on the CPU with parameters sent to the meta device as they are registered
(no parameter memory is kept): first the owner alone (``type(owner)(owner.config)``, what
HF's rotary embeddings and embeddings take), else the whole model from ``model.config``.

Example:
    >>> missing_buffers(meta_llama, ["model.rotary_emb.inv_freq"])["model.rotary_emb.inv_freq"].shape
    torch.Size([4])
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from autopar.errors import CheckpointError


def missing_buffers(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """name -> full CPU tensor, for each buffer in ``names`` (parameters cannot be computed)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    bad = [n for n in names if n in params]
    if bad:
        raise CheckpointError(
            f"load_pretrained: parameters {bad[:5]} are not in the checkpoint; it was saved "
            "for another model (or with other names)."
        )
    out, rest = {}, []
    for name in names:
        path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(path)
        fresh = _rebuild(owner, getattr(owner, "config", None))
        if fresh is not None and leaf in dict(fresh.named_buffers(recurse=False)):
            out[name] = getattr(fresh, leaf)
        else:
            rest.append(name)
    if rest:
        whole = _rebuild(model, getattr(model, "config", None))
        if whole is None:
            raise CheckpointError(
                f"load_pretrained: buffers {rest[:5]} are not in the checkpoint and the model "
                "has no config to rebuild them from; pass buffers={name: tensor}."
            )
        found = dict(whole.named_buffers())
        out.update({n: found[n] for n in rest if n in found})
    return out


def _rebuild(module: nn.Module, config):
    """``type(module)(config)`` with its parameters on the meta device, or None if that fails."""
    if config is None:
        return None
    try:
        with torch.device("cpu"), params_on_meta():
            return type(module)(config)
    except Exception:  # noqa: BLE001 - a constructor that takes other arguments: try the next way
        return None


@contextlib.contextmanager
def params_on_meta():
    """Every Parameter registered meanwhile is moved to the meta device (buffers stay real)."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
