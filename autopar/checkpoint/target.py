"""What a checkpoint reads from one rank: its plan, rank, local tensors by serial name, and
the serial (global) shape and placements of each.

A target is an emitted rank module (ap.parallelize, plan.module(rank): ``module.autopar_plan``)
or a pipeline rank's PipelineRunner (its stages' tensors only).

Example:
    >>> t = Target.of(module)
    >>> t.tensors["fc1.weight"].shape, t.shape("fc1.weight"), t.spec("fc1.weight")
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from autopar.checkpoint.boxes import flat_range_boxes, local_boxes
from autopar.errors import CheckpointError
from autopar.placement import Replicate


class Target:
    def __init__(self, plan, rank: int, tensors: dict, params: dict, module):
        self.plan, self.rank, self.module = plan, rank, module
        self.tensors = tensors  # serial name -> local tensor (params, persistent buffers)
        self.param_names = params  # id(Parameter) -> its first serial name

    @classmethod
    def of(cls, module) -> "Target":
        """What a rank module or pipeline runner holds, through the rank protocol both share
        (codegen/rank_module.py: ``autopar_plan``, ``autopar_rank``, ``autopar_tensors()``)."""
        plan = getattr(module, "autopar_plan", None)
        if plan is None or not hasattr(module, "autopar_tensors"):
            raise CheckpointError(
                f"{type(module).__name__} is not an autopar rank module: pass the module "
                "from ap.parallelize(...) or plan.module(rank), or a plan.pipeline_runner(rank)."
            )
        rank = getattr(module, "autopar_rank", None)
        if rank is None:
            rank = dist.get_rank()
        tensors = module.autopar_tensors()
        first: dict = {}
        for name, t in tensors.items():  # id(Parameter) -> its first serial name
            if isinstance(t, nn.Parameter):
                first.setdefault(id(t), name)
        return cls(plan, rank, tensors, first, module)

    @property
    def mesh(self):
        return self.plan.mesh

    def spec(self, fqn: str) -> tuple:
        return self.plan.param_specs.get(fqn, (Replicate(),) * self.mesh.ndim)

    def shape(self, fqn: str) -> tuple:
        return tuple(_serial_shapes(self.plan)[fqn])

    def dtype(self, fqn: str):
        m = self.plan.model_tensors
        return (m["params"].get(fqn) if fqn in m["params"] else m["buffers"][fqn]).dtype

    def names(self) -> list[str]:
        """Every serial name a state dict holds (parameters, tied names included, then persistent
        buffers), in the model's order: the same on every rank, whatever the rank holds."""
        m = self.plan.model_tensors
        return list(m["params"]) + [n for n in m["buffers"] if n in m["persistent"]]

    @property
    def whole(self) -> bool:
        """Whether every rank holds a piece of every tensor (no pipeline): then a plain layout is
        a DTensor of the plan's placements, else every value is a Pieces (pieces.py)."""
        return self.plan.stage_layout is None

    def boxes(self, fqn: str, tensor, start: int | None = None) -> list:
        """The boxes of ``tensor``, this rank's piece of ``fqn``: its computed piece, or (``start``)
        a 1-D range of the flattened computed piece beginning at that element."""
        if start is None:
            return local_boxes(self.shape(fqn), self.spec(fqn), self.mesh, self.rank, tensor)
        return flat_range_boxes(self.shape(fqn), self.spec(fqn), self.mesh, self.rank, start, tensor)

    def stored_boxes(self, fqn: str, tensor) -> list:
        """The boxes of the tensor the rank's module holds for ``fqn`` (zero=3: its stored range)."""
        return self.boxes(fqn, tensor, self.stored_start(fqn))

    def stored_start(self, fqn: str) -> int | None:
        """Where the rank's tensor of ``fqn`` starts in its flattened computed piece when a
        technique stores a 1-D range of it (zero=3), else None (the computed piece itself)."""
        for technique in self.plan.options.techniques:
            start = technique.stored_start(self.plan, self.rank, fqn)
            if start is not None:
                return start
        return None


def _serial_shapes(plan) -> dict:
    shapes = getattr(plan, "_autopar_serial_shapes", None)
    if shapes is None:
        m = plan.model_tensors
        shapes = {n: tuple(t.shape) for n, t in {**m["params"], **m["buffers"]}.items()}
        plan._autopar_serial_shapes = shapes
    return shapes


def device_mesh(plan):
    """The plan's torch DeviceMesh, made once per plan (every rank must call: it makes groups)."""
    if not dist.is_available() or not dist.is_initialized():
        raise CheckpointError(
            "ap.get_state_dict needs an initialised process group (it describes each rank's "
            "piece to torch.distributed.checkpoint on the plan's DeviceMesh). Offline, use "
            "autopar.checkpoint.convert.shard_full_state / merge_full_states, or "
            "ap.set_state_dict(module, model_state_dict=<full serial tensors>)."
        )
    dm = getattr(plan, "_autopar_device_mesh", None)
    if dm is None:  # a technique running the mesh as several jobs gives this job's part
        dm = next((m for t in plan.options.techniques if (m := t.checkpoint_mesh(plan)) is not None), None)
        dm = dm if dm is not None else plan.mesh.to_device_mesh("cpu")
        plan._autopar_device_mesh = dm
    return dm
