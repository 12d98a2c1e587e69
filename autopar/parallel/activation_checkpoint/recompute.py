"""Activation checkpointing at run time: a region of the emitted program run under
``torch.utils.checkpoint`` (non-reentrant), its random draws replayed, its policy per op.

The planner (technique.py and regions.py beside this file) outlines each checkpointed block of the
one emitted program into a ``Region``: a GraphModule holding the block's nodes, called from the
program like a function (``checkpoint_blocks_3(...)`` in ``gm.code``). Calling it:

- without autograd (``torch.no_grad()``, ``inference_mode``, eval loops) runs the body as
  it is: nothing is kept, so there is nothing to recompute;
- with autograd runs ``torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False)``:
  ``"full"`` keeps only the region's inputs and reruns the whole body in backward;
  ``"selective"`` keeps the outputs of the ops ``policy`` names (torch's selective checkpoint
  contexts) and reruns the rest;
- the dropout generator (runtime/rng.py: a state tensor the body's draws advance in place)
  is put back where it was at the region's forward for the recompute and restored after it
  (runtime/rng.replayed_state), so the recompute draws exactly the forward's masks, in both rng
  modes;
- ``offload``: what the region keeps lives in host memory until its backward (offload.py:
  pinned where CUDA exists): its inputs that autograd made (the forward runs on the device
  tensors themselves; checkpoint keeps only host copies, moved back for the recompute) and,
  under a selective policy, the outputs the policy keeps (copied out as the forward makes them,
  back when the recompute asks for them); the recompute of a region starts the copies back of
  the region before it (``before``: the one the next recompute needs), ahead of need where the
  device can overlap them (offload.py: CUDA's side stream; on a CPU, at need).

Example:
    >>> region = Region("checkpoint_blocks_0", body, mode="full", mutated=[4])
    >>> out = region(x, w1, w2, ..., rng_state)     # what the emitted program calls
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.parallel.activation_checkpoint.offload import (
    Ahead,
    cached_on_host,
    host_cache,
    prefetching,
    to_device,
    to_host,
)
from autopar.runtime.eager import eager
from autopar.runtime.rng import replayed_state

MODES = ("full", "selective")
ops = torch.ops.autopar
aten = torch.ops.aten


def is_collective(op) -> bool:
    """An autopar op that communicates (its output is kept under a selective policy: running it
    again in backward would send it again). The rng draws are autopar ops too, and recomputed."""
    return getattr(op, "namespace", None) == "autopar" and op._opname not in _LOCAL_AUTOPAR_OPS


# autopar ops that run on this rank alone: recomputing them repeats no communication
_LOCAL_AUTOPAR_OPS = frozenset({"dropout_mask", "random_draw", "shard", "scale_grad"})


def save_policy(save_ops: frozenset, every: int = 1, counted: frozenset = frozenset()):
    """The selective policy: keep the outputs of ``save_ops`` and of every collective, recompute
    everything else (pointwise ops, norms, activations, dropout); of the ``counted`` ops (the
    matmuls) only every ``every``-th of a region's run, the 1st, (every+1)-th, ... (one policy per
    call: the forward and its recompute count alike)."""
    seen = {False: 0, True: 0}  # the forward's count and the recompute's

    def policy(ctx, op, *args, **kwargs):
        if is_collective(op):
            return CheckpointPolicy.MUST_SAVE
        if op in save_ops and op in counted and every > 1:
            seen[ctx.is_recompute] += 1
            if (seen[ctx.is_recompute] - 1) % every:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if op in save_ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Fresh:
    """A context manager made anew by ``make`` each time it is entered: torch's checkpoint enters
    its recompute context once per recompute, and a region whose backward runs in two calls (a
    zero-bubble stage's B, then its W) recomputes twice (a generator's context enters once only)."""

    def __init__(self, make):
        self.make, self.entered = make, []

    def __enter__(self):
        cm = self.make()
        self.entered.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)


@contextlib.contextmanager
def _all(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def _activation(a) -> bool:
    """A tensor autograd made in this step (an input an offloading region moves to the host); not a
    parameter, though a gather made it (zero=3's gathered blocks: marked ``autopar_parameter``)."""
    return (
        isinstance(a, torch.Tensor)
        and a.is_floating_point()
        and a.grad_fn is not None
        and not getattr(a, "autopar_parameter", False)
    )


class _Moved:
    """A region's offloaded inputs: checkpoint is handed (and keeps) host copies; the forward runs
    on the device tensors themselves (``inputs``' first call), the recompute on copies moved back
    by ``back()``, a context entered before a selective policy's mode (the copies are no op of
    the region's, which the policy would find missing in the forward's record). ``cache``: the
    selective policy's host cache; ``prev``: the same forward's call of the region before
    (weakly), whose copies back ``back()`` starts (``prefetch``)."""

    def __init__(self, originals: dict, prev=None):
        self.originals, self.devices = originals, {i: a.device for i, a in originals.items()}
        self.hosts: dict = {}
        self.back_copies: dict = {}
        self.cache, self.prev, self.ahead, self.done = None, prev, None, False

    def host(self, i: int, a):
        if i not in self.devices:
            return a
        # a leaf asking for a gradient like the tensor it copies: the recompute then saves what
        # the forward saved (no gradient flows through it: backward runs the forward's graph)
        self.hosts[i] = to_host(a).requires_grad_(a.requires_grad)
        return self.hosts[i]

    def inputs(self, kept) -> list:
        if not self.devices:
            return list(kept)
        first, self.originals = self.originals, None  # the forward: the device tensors, once
        chosen = first if first is not None else self.back_copies
        return [chosen.get(i, a) for i, a in enumerate(kept)]

    def prefetch(self) -> None:
        """Start the copies back of what this call keeps on the host (its recompute comes next)."""
        if self.done:
            return
        ahead = {i: h for i, h in self.hosts.items() if prefetching(self.devices[i])}
        if ahead and self.ahead is None:
            self.ahead = Ahead(ahead, next(self.devices[i] for i in ahead))
        for entry in cached_on_host(self.cache) if self.cache is not None else ():
            entry.prefetch()

    @contextlib.contextmanager
    def back(self):
        ahead, self.ahead, self.done = self.ahead, None, True
        self.back_copies = {
            i: ahead.take(i) if ahead is not None and i in ahead else to_device(h, self.devices[i])
            for i, h in self.hosts.items()
        }
        prev = self.prev() if self.prev is not None else None
        if prev is not None:  # the region backward reaches next: its copies travel meanwhile
            prev.prefetch()
        try:
            yield
        finally:
            self.back_copies = {}


_LATEST = threading.local()  # per thread (a simulated rank each): region -> its last call's _Moved, weakly


def _latest() -> weakref.WeakKeyDictionary:
    if not hasattr(_LATEST, "calls"):
        _LATEST.calls = weakref.WeakKeyDictionary()
    return _LATEST.calls


class Region:
    """One checkpointed region of the emitted program (see the module docstring).

    ``body``: the region's nodes as a GraphModule of its inputs (parameters and the generator
    state included, passed in by the program); ``mutated``: the inputs the body writes in
    place (the generator state, running statistics); ``save_ops``: the ops a selective
    policy keeps; ``offload``: hold what the region keeps in host memory: the activation inputs
    (those autograd made: parameters and the model's inputs are held by their owners anyway) and
    the selective policy's outputs.
    """

    def __init__(
        self, name, body, mode="full", mutated=(), save_ops=frozenset(), offload=False, save_every=1, counted=()
    ):
        self.__name__ = self.__qualname__ = name  # how the emitted program's code names it
        self.__module__ = __name__
        self.body, self.mode, self.mutated = body, mode, tuple(mutated)
        self.save_ops, self.offload = frozenset(save_ops), offload
        self.save_every, self.counted = save_every, frozenset(counted)
        self.before: Region | None = None  # the region the program calls before this one (offload's prefetch)

    def latest(self):
        """This thread's (rank's) last call of the region (its ``_Moved``, weakly), or None."""
        return _latest().get(self)

    def __repr__(self) -> str:
        return f"<{self.mode} checkpoint region {self.__name__}: {len(self.body.graph.nodes)} nodes>"

    @eager  # the region's checkpoint and replay run eagerly between compiled pieces
    def __call__(self, *args):
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is kept, nothing to recompute
            return self.body(*args)
        states = [args[i] for i in self.mutated]
        # the written inputs reach the body from here, not through checkpoint: it would refuse to
        # recompute from an input whose version moved (the forward's draws advanced the generator)
        # flat: a tuple argument (zero=3's gathered block) given as its tensors, which checkpoint
        # saves through the saved-tensor hooks (zero=3's keep (bucket, view) and gather it again);
        # a tuple it would hold as it is, the block gathered from forward to backward
        flat, spec = pytree.tree_flatten([a for i, a in enumerate(args) if i not in self.mutated])
        prev = self.before.latest() if self.offload and self.before is not None else None
        moved = _Moved({i: a for i, a in enumerate(flat) if self.offload and _activation(a)}, prev)
        if self.offload:
            _latest()[self] = weakref.ref(moved)
        flat = [moved.host(i, a) for i, a in enumerate(flat)]
        context_fn = functools.partial(self._contexts, states, [s.clone() for s in states], moved)
        run = functools.partial(self._run, moved, states, spec)
        return checkpoint(run, *flat, use_reentrant=False, context_fn=context_fn, preserve_rng_state=True)

    def _run(self, moved: _Moved, states: list, spec, *flat):
        kept = pytree.tree_unflatten(moved.inputs(flat), spec)
        it, written = iter(kept), iter(states)
        n = len(kept) + len(states)
        return self.body(*(next(written) if i in self.mutated else next(it) for i in range(n)))

    def _contexts(self, states, snapshots, moved: _Moved):
        if self.mode == "selective":
            policy = save_policy(self.save_ops, self.save_every, self.counted)
            forward, recompute = create_selective_checkpoint_contexts(policy)
            if self.offload:  # the policy's cache, its tensors on the host (shared by both modes)
                assert hasattr(forward, "storage") and hasattr(recompute, "storage"), "torch's SAC modes changed"
                forward.storage = recompute.storage = moved.cache = host_cache()
        else:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        # the state is set and the inputs moved back outside the policy's mode; made afresh at each
        # recompute: a zero-bubble schedule's B and W are two backward calls, each recomputing
        return forward, _Fresh(lambda: _all(replayed_state(states, snapshots), moved.back(), recompute))
