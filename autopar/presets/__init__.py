"""Annotation presets found from the traced graph.

Example:
    >>> ann = ap.presets.megatron(model, "tp", args=(idx,))
"""

from autopar.presets.megatron_plan import Preset, megatron

__all__ = ["Preset", "megatron"]
