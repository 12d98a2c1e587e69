"""autopar: annotate a few layers, get one trainable torch.fx module per rank.

Example:
    >>> import autopar as ap
    >>> mesh = ap.Mesh((2, 2), ("dp", "tp"))
    >>> plan = ap.plan(model, mesh, args=(x,), annotations={"mlp.fc": ap.colwise("tp"),
    ...                "mlp.proj": ap.rowwise("tp")}, data_parallel="dp")
    >>> plan.check(x)
    >>> module = ap.parallelize(model, mesh, args=(x,), ...)   # in a torchrun job: this rank's module
"""

import importlib
from typing import TYPE_CHECKING

from autopar import presets
from autopar.api import compile, parallelize, plan
from autopar.planner import load_plan
from autopar.checkpoint import CheckpointError, load_pretrained, save_pretrained

if TYPE_CHECKING:  # imported on first use (__getattr__ below); named here for type checkers and the API docs
    from autopar.checkpoint.state_dict import get_state_dict, set_state_dict
from autopar.errors import (
    AnnotationError,
    FaultToleranceError,
    InconsistentPlanError,
    InputError,
    MeshError,
    NoRuleError,
    PlanError,
    PlanMismatch,
    ShardingError,
    TraceError,
)
from autopar.cost.plan_cost import Cost
from autopar.explore.plan_file import PlanFileError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.parallel.activation_checkpoint.technique import ActivationCheckpoint
from autopar.parallel.context import ContextParallel
from autopar.parallel.data_parallel.technique import DataParallel, DataParallelError
from autopar.parallel.experts import ExpertParallel, expert_parallel
from autopar.parallel.fault_tolerant import FaultTolerant
from autopar.parallel.float8 import Float8
from autopar.parallel.grad_scaler import GradScaler
from autopar.parallel.data_parallel.precision import MixedPrecision
from autopar.parallel.optimizer import Optimizer
from autopar.parallel.pipeline import Pipeline, PipelineError, split_before
from autopar.parallel.data_parallel.zero import ZeroOptimizer
from autopar.placement import Partial, Replicate, Shard
from autopar.plan import Plan
from autopar.runtime.comm_stats import CommStats, comm_stats
from autopar.runtime.failures import CollectiveError
from autopar.runtime.grad_clip import clip_grad_norm_
from autopar.runtime.rng import manual_seed
from autopar.runtime.simulator import SimulationError
from autopar.search import Auto, calibrate, predict
from autopar.sharding.rules.batch_norm import sync_batch_norm
from autopar.sharding.annotations import (
    colwise,
    place,
    replicate,
    replicated,
    rowwise,
    sequence_parallel,
    vocab_parallel,
)
from autopar.trace.opaque import opaque

__all__ = [
    "ActivationCheckpoint",
    "AnnotationError",
    "Auto",
    "CheckpointError",
    "CollectiveError",
    "CommStats",
    "ContextParallel",
    "Cost",
    "DataParallel",
    "DataParallelError",
    "ExpertParallel",
    "FaultToleranceError",
    "FaultTolerant",
    "Float8",
    "GradScaler",
    "InconsistentPlanError",
    "InputError",
    "Mesh",
    "MeshError",
    "MixedPrecision",
    "NoRuleError",
    "Optimizer",
    "Partial",
    "Pipeline",
    "PipelineError",
    "Plan",
    "PlanError",
    "PlanFileError",
    "PlanMismatch",
    "PlanOptions",
    "Replicate",
    "Shard",
    "ShardingError",
    "SimulationError",
    "TraceError",
    "ZeroOptimizer",
    "calibrate",
    "clip_grad_norm_",
    "colwise",
    "comm_stats",
    "compile",
    "expert_parallel",
    "get_state_dict",
    "load_plan",
    "load_pretrained",
    "manual_seed",
    "opaque",
    "parallelize",
    "place",
    "plan",
    "predict",
    "presets",
    "replicate",
    "replicated",
    "rowwise",
    "save_pretrained",
    "sequence_parallel",
    "set_state_dict",
    "split_before",
    "sync_batch_norm",
    "vocab_parallel",
]


def __getattr__(name: str):
    """ap.get_state_dict / ap.set_state_dict import DCP's DTensor machinery on first use
    (autopar/checkpoint/__init__.py says why)."""
    if name in ("get_state_dict", "set_state_dict"):
        return getattr(importlib.import_module("autopar.checkpoint"), name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
