"""Data parallelism, one folder: ``ap.DataParallel`` (technique.py), its storage policy per ZeRO
level (storage.py: replicated, ZeRO 1-2's sharded optimizer in zero.py; fsdp.py, fsdp_layout.py
and fsdp_runtime.py: zero=3 and HSDP), local SGD (local_sgd.py), written buffers kept equal
(buffer_sync.py) and the precision policy (precision.py: ``ap.MixedPrecision``, also given as
``ap.DataParallel(param_dtype=...)``). The gradient buckets and their sync (parallel/grad_buckets.py,
grad_sync.py, dp_module.py) are shared by every plan whose gradients arrive in parts, so they sit
beside the techniques.

Example:
    >>> from autopar.parallel.data_parallel import DataParallel
    >>> DataParallel.of("dp").axis
    'dp'
"""

from autopar.parallel.data_parallel.precision import MixedPrecision
from autopar.parallel.data_parallel.technique import DataParallel

__all__ = ["DataParallel", "MixedPrecision"]
