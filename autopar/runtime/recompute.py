"""Activation checkpointing at run time: a region of the emitted program run under
``torch.utils.checkpoint`` (non-reentrant), its random draws replayed, its policy per op.

The planner (parallel/activation_checkpoint.py) outlines each checkpointed block of the one
emitted program into a ``Region``: a GraphModule holding the block's nodes, called from the
program like a function (``checkpoint_blocks_3(...)`` in ``gm.code``). Calling it:

- without autograd (``torch.no_grad()``, ``inference_mode``, eval loops) runs the body as
  it is: nothing is kept, so there is nothing to recompute;
- with autograd runs ``torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False)``:
  ``"full"`` keeps only the region's inputs and reruns the whole body in backward;
  ``"selective"`` keeps the outputs of the ops ``policy`` names (torch's selective checkpoint
  contexts) and reruns the rest;
- the dropout generator (runtime/rng.py: a state tensor the body's draws advance in place)
  is put back where it was at the region's forward for the recompute and restored after it,
  so the recompute draws exactly the forward's masks, in both rng modes;
- ``offload``: the region's kept inputs live in host memory (pinned where CUDA exists): the
  program hands the region a host copy (a differentiable ``to``), the body moves it back.

Example:
    >>> region = Region("checkpoint_blocks_0", body, mode="full", mutated=[4])
    >>> out = region(x, w1, w2, ..., rng_state)     # what the emitted program calls
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("full", "selective")
ops = torch.ops.autopar
aten = torch.ops.aten


def is_collective(op) -> bool:
    """An autopar op that communicates (its output is kept under a selective policy: running it
    again in backward would send it again). The rng draws are autopar ops too, and recomputed."""
    return getattr(op, "namespace", None) == "autopar" and op._opname not in _LOCAL_AUTOPAR_OPS


# autopar ops that run on this rank alone: recomputing them repeats no communication
_LOCAL_AUTOPAR_OPS = frozenset({"dropout_mask", "random_draw", "shard", "scale_grad"})


def save_policy(save_ops: frozenset):
    """The selective policy: keep the outputs of ``save_ops`` and of every collective, recompute
    everything else (pointwise ops, norms, activations, dropout)."""

    def policy(ctx, op, *args, **kwargs):
        if op in save_ops or is_collective(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def replayed_state(states: list, snapshots: list):
    """Run with each of ``states`` (the generator state, running statistics) at its snapshot
    (the recompute draws the forward's draws again), then put back what they held (the
    step's later draws and the statistics are as if nothing was recomputed)."""
    now = [s.clone() for s in states]
    with torch.no_grad():
        for s, snap in zip(states, snapshots):
            s.copy_(snap)
    try:
        yield
    finally:
        with torch.no_grad():
            for s, kept in zip(states, now):
                s.copy_(kept)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


class _ToHost(torch.autograd.Function):
    """A device activation copied into host memory (pinned where CUDA exists); its gradient
    goes back to the device. On the CPU it is the tensor itself (nothing to move)."""

    @staticmethod
    def forward(ctx, x):
        ctx.device = x.device
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=torch.cuda.is_available())
        return host.copy_(x, non_blocking=True)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.device, non_blocking=True)


def to_host(x):
    return x if x.device.type == "cpu" else _ToHost.apply(x)


def _activation(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point() and a.grad_fn is not None


class Region:
    """One checkpointed region of the emitted program (see the module docstring).

    ``body``: the region's nodes as a GraphModule of its inputs (parameters and the generator
    state included, passed in by the program); ``mutated``: the inputs the body writes in
    place (the generator state, running statistics); ``save_ops``: the ops a selective
    policy keeps; ``offload``: hold the activation inputs (those autograd made: parameters and
    the model's inputs are held by their owners anyway) in host memory.
    """

    def __init__(self, name, body, mode="full", mutated=(), save_ops=frozenset(), offload=False):
        self.__name__ = self.__qualname__ = name  # how the emitted program's code names it
        self.__module__ = __name__
        self.body, self.mode, self.mutated = body, mode, tuple(mutated)
        self.save_ops, self.offload = frozenset(save_ops), offload

    def __repr__(self) -> str:
        return f"<{self.mode} checkpoint region {self.__name__}: {len(self.body.graph.nodes)} nodes>"

    @torch.compiler.disable  # the region's checkpoint and replay run eagerly between compiled pieces
    def __call__(self, *args):
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is kept, nothing to recompute
            return self.body(*args)
        states = [args[i] for i in self.mutated]
        context_fn = functools.partial(self._contexts, states, [s.clone() for s in states])
        # the written inputs reach the body from here, not through checkpoint: it would refuse to
        # recompute from an input whose version moved (the forward's draws advanced the generator)
        kept = [a for i, a in enumerate(args) if i not in self.mutated]
        devices = {i: a.device for i, a in enumerate(kept) if self.offload and _activation(a)}
        if devices:
            kept = [to_host(a) if i in devices else a for i, a in enumerate(kept)]
        run = functools.partial(self._run, devices, states)
        return checkpoint(run, *kept, use_reentrant=False, context_fn=context_fn, preserve_rng_state=True)

    def _run(self, devices: dict, states: list, *kept):
        if devices:  # the kept inputs come back from host memory (in the forward and the recompute)
            kept = [a.to(devices[i]) if i in devices else a for i, a in enumerate(kept)]
        it, written = iter(kept), iter(states)
        n = len(kept) + len(states)
        return self.body(*(next(written) if i in self.mutated else next(it) for i in range(n)))

    def _contexts(self, states, snapshots):
        if self.mode == "selective":
            forward, recompute = create_selective_checkpoint_contexts(save_policy(self.save_ops))
        else:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        return forward, _both(replayed_state(states, snapshots), recompute)  # state set outside the policy's mode
