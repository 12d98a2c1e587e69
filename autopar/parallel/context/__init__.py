"""Context parallel: sequences split over a mesh axis (docs/context_parallel.md).

- technique.py: ``ap.ContextParallel`` (the options, the inputs it splits, its checks, its display);
- attention_lowering.py: attention on the split sequence in the rank program (which method,
  its collectives, what it keeps and holds: the cost terms), registered with the SDPA rule;
- block_attention.py: the all-gather and ring attention at run time (BlockAttention);
- ulysses.py: Ulysses' head split and hybrid context parallel at run time;
- eager_attention.py: the eager matmul-softmax-matmul form rewritten into one SDPA node.

The zig-zag order of the pieces (``load_balance=True``) is a layout matter: placement.py holds its
permutation, sharding/piece_order.py says which values hold it.

Example:
    >>> from autopar.parallel.context import ContextParallel
    >>> ContextParallel("cp", method="ring", load_balance=True)
"""

from autopar.parallel.context.technique import ContextParallel

__all__ = ["ContextParallel"]
