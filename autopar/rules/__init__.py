"""Sharding rules, one file per op family, all registered in ``registry``.

A rule is a pure function from an ``OpInfo`` (the op's input and output shapes and its
non-tensor arguments) to the list of single-axis ``Strategy``s it allows: which placement
each tensor input needs on one mesh axis and which placement the outputs then get.
Propagation picks one strategy per mesh axis. Importing this package registers every rule.
"""
from .registry import OpInfo, Strategy, TensorMeta, get_rule, register, registered_ops  # noqa: F401
from . import pointwise, matmul, views, reductions, norms, embedding, loss, attention, creation  # noqa: F401,E402
from . import vocab_loss  # noqa: F401,E402  (after loss: extends its cross_entropy rule)
from . import hf_ops  # noqa: F401,E402
