"""autopar: annotate a few layers, get one trainable torch.fx module per rank.

Example:
    >>> import autopar as ap
    >>> mesh = ap.Mesh((2, 2), ("dp", "tp"))
    >>> plan = ap.plan(model, mesh, args=(x,), annotations={"mlp.fc": ap.colwise("tp"),
    ...                "mlp.proj": ap.rowwise("tp")}, data_parallel="dp")
    >>> plan.check(x)
"""
from autopar.sharding.annotations import colwise, place, replicate, rowwise
from autopar.sharding.annotations import sequence_parallel, vocab_parallel
from autopar.runtime.comm_stats import CommStats, comm_stats
from autopar import presets
from autopar.api import compile, plan
from autopar.errors import (AnnotationError, InputError, MeshError, NoRuleError, PlanError, PlanMismatch,
                     ShardingError, TraceError)
from autopar.mesh import Mesh
from autopar.trace.opaque import opaque
from autopar.errors import InconsistentPlanError
from autopar.runtime.failures import CollectiveError
from autopar.placement import Partial, Replicate, Shard
from autopar.plan import Plan
from autopar.parallel.pipeline import Pipeline, PipelineError, split_before
from autopar.runtime.simulator import SimulationError
from autopar.parallel.data_parallel import DataParallel, DataParallelError
from autopar.parallel.zero import ZeroOptimizer

__all__ = [
    "Mesh", "Replicate", "Shard", "Partial", "colwise", "rowwise", "replicate", "place",
    "plan", "compile", "Plan", "PlanError", "PlanMismatch", "MeshError", "AnnotationError",
    "TraceError", "ShardingError", "NoRuleError", "InputError", "SimulationError",
    "DataParallel", "DataParallelError", "ZeroOptimizer",
    "Pipeline", "PipelineError", "split_before",
    "opaque", "InconsistentPlanError", "CollectiveError",
]
__all__ += ["load_plan", "PlanFileError", "Cost"]
from autopar.explore.save_load import PlanFileError, load_plan
from autopar.explore.cost import Cost
__all__ += ["vocab_parallel", "sequence_parallel", "comm_stats", "CommStats", "presets"]
__all__ += ["get_state_dict", "set_state_dict", "CheckpointError", "load_pretrained", "save_pretrained"]
from autopar.checkpoint import CheckpointError, get_state_dict, load_pretrained, save_pretrained, set_state_dict
