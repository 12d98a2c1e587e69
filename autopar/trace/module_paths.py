"""Which modules a traced node came from (torch.export's ``nn_module_stack``), read the one way
every stage reads it.

Example:
    >>> module_path(node)            # the innermost module: 'blocks.0.attn.qkv'
    >>> module_paths(node)           # outermost first: ['blocks', 'blocks.0', 'blocks.0.attn', ...]
"""

from __future__ import annotations

import torch.fx as fx


def module_paths(node: fx.Node) -> list[str]:
    """The module paths of ``node``, outermost first ('' entries and export's own left out)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [p for p, _ in stack.values() if p and not p.startswith("_empty")]


def module_path(node: fx.Node) -> str:
    """The innermost module ``node`` came from ('' for the model's own forward)."""
    paths = module_paths(node)
    return paths[-1] if paths else ""
