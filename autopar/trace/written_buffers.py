"""Which buffers a traced program writes: batch norm's running statistics and its batch counter,
and whatever the signature returns as mutated. Data parallel broadcasts them after a training
forward (parallel/data_parallel/buffer_sync.py); fault tolerance keeps them per step
(parallel/fault_tolerant/job.py).

Example:
    >>> written(plan)        # ['bn.running_mean', 'bn.running_var', 'bn.num_batches_tracked']
"""

from __future__ import annotations

import torch


def written(plan) -> list[str]:
    """Buffers the traced program writes: returned as mutated (its signature's buffer
    mutations) or passed where an op's schema says it writes (batch norm's running stats,
    ``num_batches_tracked.add_``), in graph order."""
    out = dict.fromkeys(plan.traced.buffer_mutations.values())
    for node in plan.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        unannotated = _WRITES_UNANNOTATED.get(node.target, ())
        for i, (arg, value) in enumerate(zip(schema.arguments, node.args)):
            written = (arg.alias_info is not None and arg.alias_info.is_write) or i in unannotated
            if written and getattr(value, "op", None) == "placeholder" and value.name in plan.traced.buffer_fqn:
                out[plan.traced.buffer_fqn[value.name]] = None
    return list(out)


# composite ops that update running statistics in place although their schema does not say so
_WRITES_UNANNOTATED = {
    torch.ops.aten.batch_norm.default: (3, 4),
    torch.ops.aten.instance_norm.default: (3, 4),
}
