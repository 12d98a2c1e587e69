"""Programs that run on the device their module is on, wherever they were traced.

A trace bakes the example's device into the graph: ``torch.arange(n, device=x.device)``
becomes ``aten.arange(..., device=cpu)``, ``.to(buffer.device)`` a ``_to_copy(device=cpu)``,
and export's metadata asserts name it too. A plan traced on the CPU (or on the meta device)
and moved to CUDA with ``module.to("cuda")`` then made its masks and positions on the CPU,
and the first CUDA op that met one failed. ``bind_device`` replaces every device written in
the graph by one ``get_attr`` of ``autopar_device``: the device of the module's own tensors
(``RankModule.autopar_device``), read once per call, so the program follows its module.

Example:
    >>> bind_device(graph)          # before the program's code is generated (codegen/program.py)
    >>> gm.to("cuda")               # its aranges and masks are now made on cuda too
"""

from __future__ import annotations

import torch
import torch.fx as fx

DEVICE_ATTR = "autopar_device"


def bind_device(graph: fx.Graph) -> int:
    """Every ``torch.device`` in the nodes' arguments read from the module at run time; returns
    how many were replaced (0: the graph is left as it was). Run before the techniques rewrite
    the program (a checkpointed region outlined later gets the device as one of its inputs), and
    again when its code is generated (what a rewrite wrote: the same ``get_attr``)."""
    users = [n for n in graph.nodes if n.op == "call_function" and _has_device((n.args, n.kwargs))]
    if not users:
        return 0
    device = next((n for n in graph.nodes if n.op == "get_attr" and n.target == DEVICE_ATTR), None)
    if device is None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        anchor = placeholders[-1] if placeholders else None
        with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(next(iter(graph.nodes))):
            device = graph.get_attr(DEVICE_ATTR)
    count = 0
    for node in users:

        def swap(v):
            nonlocal count
            if isinstance(v, torch.device):
                count += 1
                return device
            return v

        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    return count


def _has_device(value) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.device) else v)
    return bool(found)
