"""A world of any size in one process: fake tensors on the plan's device, torch's fake process
group (every collective returns at once, moving nothing), and autopar's torch.distributed
backend over its groups, so a rank program runs exactly the calls it makes on a cluster.

On a torch built without CUDA, FakeTensorMode makes ``device="cuda"`` tensors but runs no op on
them: indexing asks for a CUDA device guard, and backward for an accelerator, which a CPU build
lacks (torch 2.13; a PrivateUse1 stand-in with torch's Python device guard aborts in backward's
stream guard). There the meta device stands in: fake tensors on it check what CUDA would (a CPU
tensor meeting one of them raises FakeTensorDeviceMismatchError) and hold no memory.

Example:
    >>> dev = fake_device("cuda")                      # cuda, or meta on a CPU-only torch
    >>> with fake_world(plan, rank=3, counter=mem) as stats:   # a CommStats of rank 3's collectives
    ...     module(*inputs)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from autopar.errors import MeshError
from autopar.parallel.process_groups import plan_groups
from autopar.runtime.backend import use_backend
from autopar.runtime.comm_stats import CommStats
from autopar.runtime.dist_backend import DistBackend

BACKEND = "autopar_fake"
COLLECTIVES = (
    "all_reduce",
    "all_reduce_",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "ring_shift",
    "all_reduce_async",
    "broadcast",
    "reduce_scatter_async",
    "all_gather_async",
)


def fake_device(device) -> torch.device:
    """The device fake tensors are made on for ``device``: itself, or meta for CUDA where this
    torch has none (the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.backends.cuda.is_built():
        return torch.device("meta")
    return device


def _register_backend() -> None:
    if BACKEND.upper() in dist.Backend.backend_list or BACKEND in dist.Backend.backend_list:
        return
    from torch._C._distributed_c10d import FakeProcessGroup  # torch's fake process group

    dist.Backend.register_backend(
        BACKEND,
        lambda common, opts: FakeProcessGroup._create_internal(common.group_rank, common.group_size, opts),
        extended_api=True,
        devices=["cpu", "cuda", "meta"],
    )


class FakeWorldBackend(DistBackend):
    """DistBackend over the fake groups; what a collective allocates is counted as communication."""

    def __init__(self, groups: dict, rank: int, counter):
        super().__init__(groups, rank)
        self.counter = counter


def _counted(name):
    def method(self, *args, **kwargs):
        if self.counter is None:
            return getattr(DistBackend, name)(self, *args, **kwargs)
        with self.counter.kind("communication"):
            return getattr(DistBackend, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in COLLECTIVES:
    setattr(FakeWorldBackend, _name, _counted(_name))


@contextlib.contextmanager
def fake_world(plan, rank: int, counter=None):
    """``rank`` of a fake world of the plan's size, its groups made and autopar's backend over
    them in use; yields the CommStats of its collectives. The default process group is torch's
    one per process: a job that has one already cannot dry-run inside it."""
    if dist.is_initialized():
        raise MeshError(
            "plan.dry_run makes a fake process group of the plan's world size, and this process has a "
            "torch.distributed group already: dry-run outside the job (a plain python process)."
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # imports torch's test utilities

    _register_backend()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=plan.mesh.size)
    try:
        world = dist.get_world_size()
        groups = {g: dist.new_group(list(g)) if len(g) < world else dist.group.WORLD for g in plan_groups(plan)}
        backend = FakeWorldBackend(groups, rank, counter)
        backend.stats = stats = CommStats()
        with use_backend(backend):
            yield stats
    finally:
        dist.destroy_process_group()
