"""Fault tolerance built on torchft: ap.FaultTolerant (technique.py), its run-time half
(runtime.py: process groups and the backend; job.py: the Manager, healing, checkpoints,
written buffers) and the lighthouse that agrees each step's quorum (lighthouse.py).

Example:
    >>> from autopar.parallel.fault_tolerant import FaultTolerant, start_lighthouse
"""

from autopar.parallel.fault_tolerant.lighthouse import Lighthouse, start_lighthouse
from autopar.parallel.fault_tolerant.technique import FaultTolerant

__all__ = ["FaultTolerant", "Lighthouse", "start_lighthouse"]
