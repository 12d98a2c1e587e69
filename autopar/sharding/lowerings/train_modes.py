"""Lowerings of the ops whose behaviour depends on the module's mode or on randomness.

torch.export bakes the model's mode into the graph (``dropout(x, 0.1, True)``,
``batch_norm(..., training=True, ...)``, ``num_batches_tracked.add_(1)``). An emitted rank
module must follow its own ``.train()`` / ``.eval()`` at run time, as the serial model does,
so these ops read the module's ``training`` attribute instead of the traced constant. A flag
that differs from the mode the model was traced in was written by the model itself
(``F.dropout(x, training=False)``) and stays as traced.

Dropout also gets its mask from the placements of its tensor (see rng.py): the same on every
rank that holds the same piece, or in ``rng="serial"`` mode the serial model's mask.

Example (rank 0 of tp=2, dropout on an activation split on its last dim):
    autopar_runtime_rng_dropout(gelu, 0.1, training, autopar_rng_state, [1, 1, 2], [2, 2, 0, 1], 0)
"""

from __future__ import annotations

import torch

from autopar.runtime import rng
from autopar.placement import Shard, shard_factor

aten = torch.ops.aten


def follows_mode(em, node, flag) -> bool:
    """The traced flag is the model's mode at tracing (not one the model's code fixed)."""
    return isinstance(flag, bool) and flag == em.plan.traced.training


def cuts_of(em, node, dims=None) -> list:
    """(dim, pieces, this rank's coordinate, blocks, global size, zig-zag) per axis splitting
    ``node``'s value (on ``dims``): rng.CUT entries each; the size is 0 where it is known at run
    time only; zig-zag 1 on an axis whose pieces are in that order (load-balanced context
    parallel): the serial draw is cut as plan.local_inputs cuts, chunks coord and 2n-1-coord."""
    cuts = []
    val = node.meta.get("val")
    for axis, pl in enumerate(node.meta["autopar"].spec):
        if isinstance(pl, Shard) and (dims is None or pl.dim in dims):
            zigzag = int(em.orders.zigzag_out(node, axis))
            cuts += [pl.dim, em.mesh.shape[axis], em.coord(axis), pl.blocks, static_size(val, pl.dim), zigzag]
    return cuts


def static_size(val, dim: int) -> int:
    """Dim ``dim`` of ``val`` where it is static, else 0 (sized at run time)."""
    size = val.shape[dim] if isinstance(val, torch.Tensor) and dim < val.dim() else None
    if isinstance(size, torch.SymInt):
        return int(size.node.expr) if size.node.expr.is_number else 0
    return int(size) if size is not None else 0


def training(em):
    """The rank module's ``training`` attribute, read once per forward."""
    return em.rank_value("training")


def lower_dropout(em, node, args, kwargs):
    """dropout(x, p, train) -> rng.dropout(x, p, <train>, state, factors, cuts, mode)."""
    x, p = args[0], args[1]
    train = args[2] if len(args) > 2 else kwargs.get("train", True)
    if follows_mode(em, node, train):
        train = training(em)
    if train is False or p == 0.0:
        return em.graph.call_function(aten.dropout.default, (x, p, train))
    spec = node.meta["autopar"].spec
    ndim = node.meta["val"].dim()
    factors = [shard_factor(spec, em.mesh, d) for d in range(ndim)]
    cuts = cuts_of(em, node)
    mode = rng._SERIAL if em.plan.options.rng == "serial" else rng._PLACEMENT
    state = em.rank_value(rng.STATE)
    order = rng.serial_order(em.plan.traced, em.plan.model, node.args[0]) if mode == rng._SERIAL else []
    return em.graph.call_function(rng.dropout, (x, p, train, state, factors, cuts, mode, order))


def lower_batch_norm(em, node, args, kwargs):
    """batch_norm's ``training`` (batch statistics, running-stat update) follows the module.

    Without running statistics (track_running_stats=False) the serial module always uses batch
    statistics, and the traced flag is True whatever the mode: left as traced."""
    args = list(args)
    if len(args) > 5 and args[3] is not None and follows_mode(em, node, args[5]):
        args[5] = training(em)
    return em.graph.call_function(node.target, tuple(args), kwargs)


def lower_add_(em, node, args, kwargs):
    """``num_batches_tracked.add_(1)``: counted in training mode only, as BatchNorm does."""
    target = node.args[0]
    fqn = em.plan.attr_name(target.name) if getattr(target, "op", None) == "placeholder" else None
    if fqn is None or not fqn.endswith("num_batches_tracked") or not follows_mode(em, node, True):
        return None
    return em.graph.call_function(count_batch, (args[0], args[1], training(em)))


def count_batch(counter: torch.Tensor, step, train: bool) -> torch.Tensor:
    """BatchNorm's batch counter: ``counter += step`` in training mode, unchanged in eval."""
    return counter.add_(step) if train else counter
