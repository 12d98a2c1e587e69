"""ZeRO stages 1 and 2 on the data-parallel axis: each dp rank owns a contiguous 1/dp slice
of every gradient bucket's flat parameter vector, and only that slice's optimizer state.

At build time the parameters of each dp bucket are moved into one flat buffer (padded to a
multiple of dp) and become views of it, so the owner's in-place optimizer update lands in
the module's parameters and one all-gather per bucket brings every rank's updated slice
everywhere, with no copy back. The optimizer sees, per parameter, the 1-D piece of it that
falls in this rank's slice, so any optimizer whose update is elementwise per tensor (SGD,
Adam, AdamW, Adagrad, RMSprop, NAdam, RAdam, Adamax, Adadelta, ASGD, Rprop: every
torch.optim class but LBFGS, SparseAdam and Adafactor, which need whole tensors) gives
exactly the unsharded result. Optimizer state per rank is 1/dp of the unsharded state.

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), data_parallel=ap.DataParallel("dp", zero=2))
    >>> module = plan.module(rank)               # or ap.parallelize(...)
    >>> opt = ap.ZeroOptimizer(module, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    >>> loss.backward(); opt.step(); opt.zero_grad()
    >>> opt.state_bytes()                        # this rank's optimizer-state bytes (1/dp)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import DataParallelError
from autopar.parallel.param_groups import group_params, zero_grads
from autopar.parallel.protocols.storage import GradShards, SlicedOptimizer
from autopar.runtime.backend import current_backend

WHOLE_TENSOR_OPTIMIZERS = ("LBFGS", "SparseAdam", "Adafactor")


@dataclass
class Piece:
    name: str  # the parameter this piece belongs to
    tensor: torch.Tensor  # 1-D view of the bucket's flat buffer: what the optimizer steps
    lo: int  # offsets within this rank's slice of the bucket
    hi: int


class ZeroShards(GradShards):
    """The flat buffers of the dp buckets, this rank's slice of each, and its pieces. A bucket is
    sliced over its sync group: the dp ranks, or the dp x cp ranks where ``shard_axes`` folds cp in
    (``sync.groups``). Made by the storage of ``level`` 1 or 2 (``ShardedOptimizer.grad_shards``),
    bound to the gradient sync's dp buckets once it has made them (``bind``).

    Example:
        >>> shards = ZeroShards(level=2)                   # the gradient sync then calls:
        >>> shards.bind(sync, [i for i, b in enumerate(sync.buckets) if sync.on_dp(b)])
    """

    def __init__(self, level: int):
        self.level, self.reduce_scatters = level, level == 2  # ZeRO-2 reduce-scatters the buckets
        self.stepped_by = None  # the optimizer stepping the slices (ap.ZeroOptimizer, ap.Optimizer), once made

    def bind(self, sync, bucket_ids: list[int]) -> None:
        self.sync, self.bucket_ids = sync, bucket_ids
        self.groups = {i: sync.groups[i] for i in bucket_ids}
        self.n = {i: len(g) for i, g in self.groups.items()}
        self.pos = {i: g.index(sync.rank) for i, g in self.groups.items()}
        self.flats: dict[int, torch.Tensor] = {}
        self.pieces: dict[int, list[Piece]] = {}
        for i in bucket_ids:
            self._flatten(i)

    def chunk(self, i: int) -> int:
        return -(-self.sync.buckets[i].numel // self.n[i])

    def _flatten(self, i: int) -> None:
        bucket, params = self.sync.buckets[i], self.sync.params
        first = params[bucket.names[0]]
        flat = torch.zeros(self.chunk(i) * self.n[i], dtype=bucket.dtype, device=first.device)
        lo, hi = self.pos[i] * self.chunk(i), (self.pos[i] + 1) * self.chunk(i)
        pieces, offset = [], 0
        with torch.no_grad():
            for name in bucket.names:
                p = params[name]
                k = p.numel()
                flat[offset : offset + k].copy_(p.detach().reshape(-1))
                p.data = flat[offset : offset + k].view_as(p)  # the parameter now lives in the flat
                a, b = max(offset, lo), min(offset + k, hi)
                if a < b:
                    pieces.append(Piece(name, flat[a:b], a - lo, b - lo))
                offset += k
        self.flats[i], self.pieces[i] = flat, pieces

    def own_slice(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a bucket-sized flat tensor (the padding left out)."""
        c = self.chunk(i)
        return full[self.pos[i] * c : min((self.pos[i] + 1) * c, full.numel())]

    def set_grad(self, i: int, chunk: torch.Tensor, accumulate: bool = True) -> None:
        """Hand this rank's reduced gradient slice of bucket ``i`` to its pieces (ZeRO-2 adds it
        to what they hold: backwards without zero_grad accumulate, as parameters' .grad do)."""
        for piece in self.pieces[i]:
            if not self.sync.params[piece.name].requires_grad:
                piece.tensor.grad = None  # frozen after planning: its slice is not stepped
                continue
            g = chunk[piece.lo : piece.hi]
            held = piece.tensor.grad
            piece.tensor.grad = held.add_(g) if accumulate and held is not None else g

    def clear_grads(self, set_to_none: bool = True) -> None:
        """What the module's zero_grad() clears beside its parameters' .grad: ZeRO-2's slice
        gradients, which the next backward adds to (ZeRO-1's slices are views of the module's
        gradients, set again by every sync)."""
        if not self.reduce_scatters:
            return
        for piece in self.all_pieces():
            if piece.tensor.grad is not None:
                if set_to_none:
                    piece.tensor.grad = None
                else:
                    piece.tensor.grad.zero_()

    def all_pieces(self) -> list[Piece]:
        return [p for i in self.bucket_ids for p in self.pieces[i]]

    def all_gather(self) -> None:
        """Every rank's updated slice to every rank: one collective per bucket, waited once."""
        backend, works = current_backend(), []
        for i in self.bucket_ids:
            c = self.chunk(i)
            mine = self.flats[i][self.pos[i] * c : (self.pos[i] + 1) * c].clone()
            works.append(backend.all_gather_async(self.flats[i], mine, self.groups[i], self.sync.rank))
        for w in works:
            w.wait()

    def sliced_names(self) -> set[str]:
        return {n for i in self.bucket_ids for n in self.sync.buckets[i].names}

    def slice_tensors(self, names) -> list[torch.Tensor]:
        return [piece.tensor for piece in self.all_pieces() if piece.name in names]

    def gather_grads(self) -> None:
        """ZeRO-2 keeps only each rank's reduced slice of a bucket's gradient: all-gather the slices
        over the bucket's group into the parameters' .grad (a whole-tensor optimizer reads every
        element). ZeRO-1's .grad are whole already."""
        if not self.reduce_scatters:
            return
        backend, sync = current_backend(), self.sync
        for i in self.bucket_ids:
            mine = torch.zeros(self.chunk(i), dtype=sync.buckets[i].dtype)
            for piece in self.pieces[i]:
                if piece.tensor.grad is not None:
                    mine[piece.lo : piece.hi] = piece.tensor.grad
            full = backend.all_gather(mine, 0, self.groups[i], sync.rank)
            at = 0
            for n in sync.buckets[i].names:
                p = sync.params[n]
                if p.requires_grad:
                    p.grad = full[at : at + p.numel()].view_as(p).clone()
                at += p.numel()

    def check_stepped(self) -> None:
        if self.stepped_by is not None:
            return
        sync, dp = self.sync, self.sync.dp
        raise DataParallelError(
            f"DataParallel(zero={self.level}): each rank steps only its 1/{len(sync.dp_group())} slice of every "
            "gradient bucket, which no module parameter is, so a plain torch.optim optimizer over "
            "module.parameters() would step whole parameters on partial or missing gradients. Before backward, "
            "write opt = ap.Optimizer(module, torch.optim.AdamW, lr=...) in place of "
            "torch.optim.AdamW(module.parameters(), lr=...) (any torch.optim class; per-group options as "
            "param_groups=[{'params': ['*.bias'], 'weight_decay': 0}]), or plan with a storage a plain optimizer "
            f"steps: ap.DataParallel({dp.axis!r}, zero=0 or 3), or ap.Auto(zero=(0, 3)) for the search."
        )

    def optimizer_for(self, module, optimizer_class, param_groups, **defaults) -> "ZeroOptimizer":
        return ZeroOptimizer(module, optimizer_class, param_groups, **defaults)


class ZeroOptimizer(torch.optim.Optimizer, SlicedOptimizer):
    """Any elementwise torch optimizer, stepping only this rank's ZeRO slice.

    ``param_groups``: optional list of dicts whose "params" are parameter-name patterns
    (fnmatch), with per-group options, e.g. ``[{"params": ["*.bias", "*ln*"], "weight_decay": 0}]``;
    parameters matching no group use the keyword defaults. ``state_dict()`` is this rank's shard.

    Example:
        >>> opt = ap.ZeroOptimizer(module, torch.optim.AdamW, lr=1e-3)
    """

    def __init__(self, module: torch.nn.Module, optimizer_class, param_groups: list[dict] | None = None, **defaults):
        sync = getattr(module, "autopar_grad_sync", None)
        if sync is None or sync.shards is None:
            raise DataParallelError(
                "ap.ZeroOptimizer needs a module planned with "
                "data_parallel=ap.DataParallel('dp', zero=1 or 2); for zero=0 and zero=3 use "
                f"{getattr(optimizer_class, '__name__', optimizer_class)}(module.parameters())."
            )
        if getattr(optimizer_class, "__name__", "") in WHOLE_TENSOR_OPTIMIZERS:
            raise DataParallelError(
                f"{optimizer_class.__name__} needs whole parameter tensors; ZeRO gives each "
                "rank a flat slice. Use an elementwise optimizer (SGD, Adam, AdamW, ...) "
                "or zero=0."
            )
        self.module, self.shards = module, sync.shards
        groups = self._groups(sync, param_groups or [])
        self.optim = optimizer_class(groups, **defaults)
        super().__init__(groups, self.optim.defaults)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state  # one truth
        self.shards.stepped_by = self  # the gradient sync's check: an optimizer is attached

    def _groups(self, sync, spec: list[dict]) -> list[dict]:
        """The optimizer's param groups: this rank's pieces plus trainable params not on dp."""
        sharded = self.shards.sliced_names()
        tensors = [(p.name, p.tensor) for p in self.shards.all_pieces()]
        tensors += [(n, p) for n, p in sync.params.items() if p.requires_grad and n not in sharded]
        trainable = [n for n, p in sync.params.items() if p.requires_grad]  # the same on every dp rank
        return group_params(tensors, spec, trainable)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self.shards.all_gather()
        return loss

    def stepped_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` ap.GradScaler unscales: ZeRO-2's slices and the parameters
        not on dp (the param groups); under ZeRO-1 the module's parameters, whose full gradients
        the slices are views of (each element once, and clipping reads the full ones)."""
        if self.shards.level != 1:
            return [p for g in self.param_groups for p in g["params"]]
        seen: dict = {}
        for p in self.shards.sync.params.values():
            if p.requires_grad:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def param_slices(self) -> dict:
        params = self.shards.sync.params
        return {
            piece.tensor: (params[piece.name], piece.tensor.storage_offset() - params[piece.name].storage_offset())
            for piece in self.shards.all_pieces()
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)
        zero_grads(self.module.parameters(), set_to_none)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optim.load_state_dict(state_dict)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (1/dp of the unsharded optimizer's)."""
        return state_bytes(self.optim)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in an optimizer's state (any optimizer)."""
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
