"""Dry runs: a rank's program at full size on fake tensors, whole training steps in a fake world.

``dry_run(plan)`` builds each distinct rank's module with its parameters, buffers and inputs at
the plan's sizes as fake tensors on ``device`` (no memory, no data), moves it there as a user
would (``module.to(device)``), and runs ``steps`` training steps as a training loop does:
forward, ``loss.backward()`` (the gradient sync, zero=3's gathers and frees, checkpointing's
recompute run inside), the optimizer's step and ``zero_grad``, over torch's fake process group
of the plan's world size (fake_world.py). It counts every allocation (memory.py), every
collective (autopar's backend reports each one) and the FLOPs (FlopCounterMode), and puts them
beside the plan's figures for that rank (report.py). Where a technique runs a rank's step itself
(its runtime hook ``dry_run_rank``: a pipelined plan's rank runs its PipelineRunner's step, its
messages carried by the fake world, parallel/pipeline/dry_run.py), the dry run runs that step and
asks the technique for the figures.

Example:
    >>> report = dry_run(plan, device="cuda", steps=2)
    >>> report.peak_bytes / plan.memory_per_rank(report.peak_rank).peak
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from autopar.cost.collectives import _sync_comms, collectives
from autopar.cost.formulas import PlanSymbols
from autopar.dryrun.attention import flash_attention_on_meta
from autopar.dryrun.fake_world import fake_device, fake_world
from autopar.dryrun.flops import counting_flops
from autopar.runtime.collectives import eager_emulated
from autopar.dryrun.memory import MemoryCounter
from autopar.dryrun.report import DryRun, RankRun
from autopar.dryrun.where import failing_node
from autopar.errors import MeshError, PlanError
from autopar.parallel.dp_module import memory_per_rank, memory_ranks
from autopar.parallel.optimizer import Optimizer
from autopar.parallel.param_names import stored_pieces
from autopar.runtime.comm_stats import _axis, group_label
from autopar.trace.in_dtype import materialized


def dry_run(plan, rank=None, device="cuda", steps=2, optimizer=torch.optim.AdamW, **optimizer_kwargs) -> DryRun:
    """Run ``rank``'s program (None: every distinct one, ``memory_ranks``: one per pipeline
    position) on fake tensors; see the module docstring. ``optimizer``: a torch.optim class,
    stepped through ap.Optimizer."""
    ranks = memory_ranks(plan) if rank is None else [rank]
    for r in ranks:
        if not 0 <= r < plan.mesh.size:
            raise MeshError(f"plan.dry_run(rank={r}): the mesh {plan.mesh} has ranks 0..{plan.mesh.size - 1}.")
    if steps < 1:
        raise PlanError(f"plan.dry_run(steps={steps}): run at least one step.")
    return DryRun({r: run_rank(plan, r, device, steps, optimizer, optimizer_kwargs) for r in ranks})


def run_rank(plan, rank: int, device, steps: int, optimizer, optimizer_kwargs: dict) -> RankRun:
    dev = fake_device(device)
    start = time.perf_counter()
    counter = MemoryCounter(dev)
    gpu = (
        flash_attention_on_meta()
        if dev.type == "meta" and torch.device(device).type == "cuda"
        else contextlib.nullcontext()
    )
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        gpu,
        counter,
        eager_emulated(),  # the program as plain eager mode runs it (no copy the real run does not make)
        fake_world(plan, rank, counter) as stats,
    ):
        own = _own_step(plan, rank, dev, stats)
        if own is not None:  # the technique's step (a pipeline rank's stages, driven by its runner)
            module, stages, inputs = own.module, own.stages, None
            for stage in stages:
                _move_buffers(stage, dev)
        else:
            module = _module(plan, rank, dev)
            inputs = _inputs(plan, rank, dev)
            stages = [module]
        counter.label(module.parameters(), "params")
        counter.label([b for m in stages for b in m.buffers()], "buffers")
        opt = Optimizer(module, optimizer, **optimizer_kwargs)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: counter.label([q.grad], "grads"))
        gc.collect()
        counter.reset_peak()  # the build's full-size state is gone: the step's peak from here
        for _ in range(steps):
            first = len(stats.records)
            with counting_flops() as flop_counter, _named(rank, dev):
                _step(module, opt, inputs, counter, own)
            flops = flop_counter.get_total_flops()
            by_op = {str(op): n for op, n in flop_counter.get_flop_counts().get("Global", {}).items()}
            collectives = [(r.kind, _label(r, plan.mesh), r.bytes) for r in stats.records[first:]]
        slots = _state_slots(opt)
        held = {k: v for k, v in counter.by_kind.items() if v}  # between steps: what a rank keeps
    mem = memory_per_rank(plan, rank, slots)
    if own is not None:
        predicted_collectives, predicted_flops = own.predicted(slots)
    else:
        predicted_collectives = _rank_collectives(plan, rank)
        predicted_flops = float(plan.cost(optimizer_states=slots, rank=rank).at()["flops"])
    return RankRun(
        rank=rank,
        device=str(dev) if dev.type == torch.device(device).type else f"{dev} (for {device}: this torch has no CUDA)",
        steps=steps,
        peak_bytes=counter.peak,
        peak_by_kind={k: v for k, v in counter.peak_by_kind.items() if v},
        held_by_kind=held,
        collectives=collectives,
        flops=float(flops),
        flops_by_op=by_op,
        seconds=time.perf_counter() - start,
        predicted_bytes=float(mem.peak),
        predicted_sum=float(mem.total),
        predicted_by_kind={k: float(v) for k, v in mem.items()},
        predicted_phases={k: float(v) for k, v in mem.phases.items()},
        predicted_collectives=predicted_collectives,
        predicted_flops=predicted_flops,
    )


def _own_step(plan, rank: int, dev, stats):
    """The DryRank of the first technique that runs ``rank``'s step itself, or None."""
    for technique in plan.options.techniques:
        own = technique.dry_run_rank(plan, rank, dev, stats)
        if own is not None:
            return own
    return None


def _rank_collectives(plan, rank: int) -> list:
    """plan.collectives() with the gradient sync of what ``rank`` stores: zero=3 cuts a flat
    bucket into ranges, so a parameter synced on another axis (a norm weight over tp) is whole on
    one rank and absent on another, where plan.collectives() lists an even share (measured: the
    405B's search choice, zero=3 over 64 ranks, rank 0 all-reduced its norm weights on tp at 64x
    the share). The same as a pipeline rank's (parallel/pipeline/dry_run.rank_sync)."""
    sy = PlanSymbols.of(plan)
    comms = collectives(plan, sy, grad_sync=False) + _sync_comms(plan, sy, rank, stored_pieces(plan, rank))
    return [(c.kind, c.axis, c.bytes) for c in comms]


def _label(record, mesh):
    """A record's axis: its own (a point-to-point message's), the mesh axis of its group, or the
    axes a group over several spans ("dp*pp": the pipeline's loss)."""
    axis = getattr(record, "axis", None)
    if axis is not None:
        return axis
    found = _axis(record.group, mesh)
    return found if isinstance(found, str) else group_label(record.group, mesh)


@contextlib.contextmanager
def _named(rank: int, dev):
    """An op that cannot run on the device raises a PlanError naming the program's node."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as e:
        where = failing_node(e.__traceback__)
        if where is None:
            raise
        mismatch = isinstance(e, FakeTensorDeviceMismatchError)
        raise PlanError(
            f"plan.dry_run: rank {rank}'s program failed on {dev} at node {where}: {e}"
            + (
                " A tensor made on another device met the program's: make it where the module is "
                "(x.device, or a registered buffer that module.to() moves)."
                if mismatch
                else " The op has no kernel for this device (or none for fake tensors): keep it out "
                "of the program (ap.opaque) or give it a fake kernel (torch.library.register_fake)."
            )
        ) from e


def _module(plan, rank: int, dev):
    """``rank``'s module with fake pieces: parameters cut from full-size fake tensors made on
    ``dev``; buffers and constants as the model holds them, then moved as a user moves a module."""
    state = {name: torch.empty(p.shape, dtype=p.dtype, device=dev) for name, p in plan.model_tensors["params"].items()}
    module = plan.build_module(rank, state=state)
    del state
    _move_buffers(module, dev)
    return module


def _move_buffers(module, dev) -> None:
    """The buffers and traced constants of a model built on the CPU or on meta moved to ``dev``, as
    ``module.to(dev)`` moves them (RankModule._apply; the parameters, fake, are there already and
    a FakeTensor parameter cannot be swapped by ``Module._apply``)."""
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.device != dev:
                mod._buffers[name] = buf.to(dev)
    for fqn in module.autopar_constants:
        path, _, leaf = fqn.rpartition(".")
        owner = module.get_submodule(path)
        setattr(owner, leaf, getattr(owner, leaf).to(dev))
    module.__dict__.pop("_autopar_device", None)


def _inputs(plan, rank: int, dev) -> tuple:
    """The rank's slice of a batch of the example's sizes (zeros: a fake tensor has no values)."""
    args, kwargs = materialized(plan.traced.example, dev)
    return plan.local_inputs(rank, *args, **kwargs)


def _step(module, opt, inputs, counter, own=None) -> None:
    if own is not None:  # the technique's (a pipeline: the schedule's forwards and backwards, the sync, the loss)
        own.step()
    else:
        args, kwargs = inputs
        out = module(*args, **kwargs)
        loss = _loss(out)
        if any(t is loss for t in pytree.tree_leaves(out)):  # the model returns its loss: the caller
            del out  # keeps it and drops the rest before backward (HF's Trainer, torchtitan's del pred),
        loss.backward()  # as the model counts them (cost/activation_memory.held_outputs)
    counter.label([p.grad for p in module.parameters()], "grads")
    with counter.kind("optimizer_state"):
        opt.step()
    counter.label([t for s in opt.state.values() for t in s.values()], "optimizer_state")
    opt.zero_grad(set_to_none=True)


def _loss(out) -> torch.Tensor:
    """The step's loss: the first scalar the program returns that has a gradient, else the sum
    of its first output that has one."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise PlanError(
            "plan.dry_run: the program returns no tensor with a gradient to run backward from; "
            "dry-run a model that returns its loss (or an output that needs a gradient)."
        )
    scalars = [t for t in leaves if t.dim() == 0]
    return scalars[0] if scalars else leaves[0].sum()


def _state_slots(opt) -> int:
    """Tensors of a parameter's size the optimizer keeps per parameter (Adam's 2, SGD with momentum
    1): the ``state_slots`` the plan's memory is asked for."""
    for state in opt.state.values():
        return sum(1 for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return 0
