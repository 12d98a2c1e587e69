"""Parallelism techniques beyond layouts: data parallel (buckets, ZeRO 1-3, local SGD, the
precision policy), the pipeline, and every other technique in this folder.

Importing this package imports every module in it, so each technique registers itself
(registry.py): adding one is dropping its folder here.

Example:
    >>> from autopar.parallel import TECHNIQUES
    >>> list(TECHNIQUES)
    ['data_parallel', 'fault_tolerant', 'expert_parallel', 'context_parallel', 'pipeline', 'float8', 'mixed_precision', 'activation_checkpoint']
"""

import importlib
import pkgutil

from autopar.parallel.registry import TECHNIQUES, register_technique

for _module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    importlib.import_module(_module.name)

__all__ = ["TECHNIQUES", "register_technique"]
