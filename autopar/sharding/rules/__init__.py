"""Sharding rules, one file per op family, all registered in ``registry``.

A rule is a pure function from an ``OpInfo`` (the op's input and output shapes and its
non-tensor arguments) to the list of single-axis ``Strategy``s it allows: which placement
each tensor input needs on one mesh axis and which placement the outputs then get.
Propagation picks one strategy per mesh axis. Importing this package registers every rule.
"""
from autopar.sharding.rules.registry import OpInfo, Strategy, TensorMeta, get_rule, register, registered_ops  # noqa: F401
from autopar.sharding.rules import pointwise
from autopar.sharding.rules import matmul
from autopar.sharding.rules import views
from autopar.sharding.rules import reductions
from autopar.sharding.rules import norms
from autopar.sharding.rules import embedding
from autopar.sharding.rules import loss
from autopar.sharding.rules import attention
from autopar.sharding.rules import creation  # noqa: F401,E402
from autopar.sharding.rules import vocab_loss  # noqa: F401,E402  (after loss: extends its cross_entropy rule)
from autopar.sharding.rules import hf_ops  # noqa: F401,E402
from autopar.sharding.rules import conv
from autopar.sharding.rules import pooling
from autopar.sharding.rules import batch_norm
from autopar.sharding.rules import resample
from autopar.sharding.rules import sorting
from autopar.sharding.rules import scatter_gather
from autopar.sharding.rules import views_extra  # noqa: F401,E402
