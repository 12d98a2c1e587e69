"""split of a blocked shard into its blocks (GPT-2's fused q|k|v split on tp): each local
block is 1/n of the global one, so the split sizes are divided by the axis size.

Example: split(qkv, [96, 96, 96]) on tp=2 with qkv S(-1, blocks=3) -> split(local, [48, 48, 48]).
"""

from __future__ import annotations

from autopar.sharding.lowerings.base import Lowering, register_lowering


class SplitBlocked(Lowering):
    name = "split_blocked"

    def emit(self, em, node, args, kwargs, axis: int):
        n = em.mesh.shape[axis]
        sizes = args[1]
        local = [s // n for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // n
        return em.graph.call_function(node.target, (args[0], local, *args[2:]), kwargs)


SPLIT_BLOCKED = register_lowering(SplitBlocked())
