"""The small protocols a parallelism technique is made of (technique.py's ``Technique`` inherits
them all): options, layout, storage, cost, runtime, display, search. A caller that needs one part of a
technique reads only that protocol's file; a technique overrides only the hooks it needs.

Example:
    >>> from autopar.parallel.protocols import CostHooks
    >>> CostHooks().recomputed(plan=None)
    set()
"""

from autopar.parallel.protocols.cost import CostHooks
from autopar.parallel.protocols.display import DisplayHooks
from autopar.parallel.protocols.layout import LayoutHooks
from autopar.parallel.protocols.options import OptionHooks
from autopar.parallel.protocols.runtime import DryRank, RuntimeHooks
from autopar.parallel.protocols.search import SearchFacts, SearchHooks
from autopar.parallel.protocols.storage import GradShards, SlicedOptimizer, StorageHooks

__all__ = [
    "CostHooks",
    "DisplayHooks",
    "DryRank",
    "GradShards",
    "LayoutHooks",
    "OptionHooks",
    "RuntimeHooks",
    "SearchFacts",
    "SearchHooks",
    "SlicedOptimizer",
    "StorageHooks",
]
