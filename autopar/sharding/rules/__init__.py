"""Sharding rules, one file per op family, all registered in ``registry``.

A rule is a pure function from an ``OpInfo`` (the op's input and output shapes and its
non-tensor arguments) to the list of single-axis ``Strategy``s it allows: which placement
each tensor input needs on one mesh axis and which placement the outputs then get.
Propagation picks one strategy per mesh axis. Importing this package registers every rule.
"""

from autopar.sharding.rules.registry import (
    ATTENTION,
    ELEMENTWISE,
    MATMUL,
    VIEW,
    OpInfo,
    OpTraits,
    Strategy,
    TensorMeta,
    Work,
    aten_ops,
    declare,
    get_rule,
    op_traits,
    register,
    register_by_name,
    registered_ops,
)

__all__ = [
    "ATTENTION",
    "ELEMENTWISE",
    "MATMUL",
    "VIEW",
    "OpInfo",
    "OpTraits",
    "Strategy",
    "TensorMeta",
    "Work",
    "aten_ops",
    "declare",
    "get_rule",
    "op_traits",
    "register",
    "register_by_name",
    "registered_ops",
]

# importing a rule file registers its rules
from autopar.sharding.rules import pointwise, matmul, views, reductions, norms  # noqa: F401
from autopar.sharding.rules import embedding, loss, attention, creation  # noqa: F401
from autopar.sharding.rules import vocab_loss  # noqa: F401  (registers cross_entropy_loss: extends loss's rule)
from autopar.sharding.rules import hf_ops  # noqa: F401
from autopar.sharding.rules import conv, pooling, batch_norm, resample  # noqa: F401
from autopar.sharding.rules import sorting, scatter_gather, views_extra  # noqa: F401
from autopar.sharding.rules import variants, histograms  # noqa: F401
from autopar.sharding.rules import pointwise_table  # noqa: F401  (after pointwise: the overloads it leaves)
from autopar.sharding.rules import reductions_dims  # noqa: F401
from autopar.sharding.rules import matrix  # noqa: F401
from autopar.sharding.rules import views_scatter  # noqa: F401  (after every view rule: *_copy reuses them)
from autopar.sharding.rules import spectral  # noqa: F401
from autopar.sharding.rules import nn_extra  # noqa: F401
from autopar.sharding.rules import norms_native  # noqa: F401
from autopar.sharding.rules import losses_batch  # noqa: F401
from autopar.sharding.rules import random_ops  # noqa: F401
