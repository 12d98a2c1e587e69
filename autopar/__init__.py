"""autopar: annotate a few layers, get one trainable torch.fx module per rank.

Example:
    >>> import autopar as ap
    >>> mesh = ap.Mesh((2, 2), ("dp", "tp"))
    >>> plan = ap.plan(model, mesh, args=(x,), annotations={"mlp.fc": ap.colwise("tp"),
    ...                "mlp.proj": ap.rowwise("tp")}, data_parallel="dp")
    >>> plan.check(x)
"""
from .annotate import colwise, place, replicate, rowwise
from .api import compile, plan
from .errors import (AnnotationError, InputError, MeshError, NoRuleError, PlanError, PlanMismatch,
                     ShardingError, TraceError)
from .mesh import Mesh
from .placement import Partial, Replicate, Shard
from .plan import Plan
from .pipeline import Pipeline, PipelineError, split_before
from .simulate import SimulationError

__all__ = [
    "Mesh", "Replicate", "Shard", "Partial", "colwise", "rowwise", "replicate", "place",
    "plan", "compile", "Plan", "PlanError", "PlanMismatch", "MeshError", "AnnotationError",
    "TraceError", "ShardingError", "NoRuleError", "InputError", "SimulationError",
    "Pipeline", "PipelineError", "split_before",
]
__all__ += ["load_plan", "PlanFileError", "Cost"]
from .saveload import PlanFileError, load_plan
from .estimate import Cost
