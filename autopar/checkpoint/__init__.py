"""Checkpoints: DCP state dicts that reshard across meshes, plans and world sizes, HF weights
straight into rank shards, and offline conversion.

Example:
    >>> model_sd, optim_sd = ap.get_state_dict(module, opt)
    >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/step100")
    >>> ap.load_pretrained(module, "hf_dir")       # a model planned on the meta device
"""

from autopar.checkpoint.hf import load_pretrained, save_pretrained
from autopar.checkpoint.state_dict import get_state_dict, set_state_dict
from autopar.errors import CheckpointError

__all__ = ["get_state_dict", "set_state_dict", "CheckpointError", "load_pretrained", "save_pretrained"]
