"""Checkpoints: DCP state dicts that reshard across meshes, plans and world sizes, HF weights
straight into rank shards, and offline conversion.

Example:
    >>> model_sd, optim_sd = ap.get_state_dict(module, opt)
    >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/step100")
    >>> ap.load_pretrained(module, "hf_dir")       # a model planned on the meta device
"""

import importlib

from autopar.checkpoint.hf import load_pretrained, save_pretrained
from autopar.errors import CheckpointError

__all__ = ["get_state_dict", "set_state_dict", "CheckpointError", "load_pretrained", "save_pretrained"]

# DCP state dicts hold DTensors (pieces.py subclasses DTensor), and importing torch.distributed.tensor
# costs 0.2-0.4 s with its op strategies: paid by the first get/set_state_dict, not by `import autopar`.
_LAZY = {"get_state_dict": "autopar.checkpoint.state_dict", "set_state_dict": "autopar.checkpoint.state_dict"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autopar.checkpoint' has no attribute {name!r}")
