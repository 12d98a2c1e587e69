"""Which modules a traced node came from (torch.export's ``nn_module_stack``), read the one way
every stage reads it.

Example:
    >>> module_path(node)            # the innermost module: 'blocks.0.attn.qkv'
    >>> module_paths(node)           # outermost first: ('blocks', 'blocks.0', 'blocks.0.attn', ...)
"""

from __future__ import annotations

import torch.fx as fx

_READ = "autopar_module_paths"  # node.meta: (the nn_module_stack read, its paths)


def module_paths(node: fx.Node) -> tuple[str, ...]:
    """The module paths of ``node``, outermost first ('' entries and export's own left out).
    Read once per stack: the search asks each node hundreds of times (a 512-rank search called
    this half a million times), so the paths are kept beside the stack they were read from and
    read again only when the node's stack is another object (a copied node shares its stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    read = node.meta.get(_READ)
    if read is not None and read[0] is stack:
        return read[1]
    paths = tuple(p for p, _ in stack.values() if p and not p.startswith("_empty"))
    if stack:
        node.meta[_READ] = (stack, paths)
    return paths


def module_path(node: fx.Node) -> str:
    """The innermost module ``node`` came from ('' for the model's own forward)."""
    paths = module_paths(node)
    return paths[-1] if paths else ""
