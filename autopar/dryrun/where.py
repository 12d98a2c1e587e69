"""Which node of a rank program raised: an error from a dry run names it.

The programs are fx GraphModules: a frame of their generated ``forward`` maps its line to a node
(``_lineno_map``, from the line where ``forward`` starts). The innermost such frame of a
traceback is the node that ran (a checkpointed region's body is a GraphModule of its own).

Example:
    >>> try: module(*args)
    ... except RuntimeError as e: print(failing_node(e.__traceback__))   # "arange (aten.arange.start)"
"""

from __future__ import annotations

import torch.fx as fx

from autopar.trace.module_paths import module_path


def failing_node(tb) -> str | None:
    """``name (target), in module path`` of the innermost program node in traceback ``tb``."""
    found = None
    while tb is not None:
        frame = tb.tb_frame
        gm = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(gm, fx.GraphModule):
            lines = getattr(gm, "_lineno_map", None) or {}
            index = lines.get(tb.tb_lineno - getattr(gm, "_prologue_start", 0))
            if index is not None:
                node = list(gm.graph.nodes)[index]
                path = module_path(node)
                found = f"{node.name} ({node.target})" + (f", in module {path}" if path else "")
        tb = tb.tb_next
    return found
