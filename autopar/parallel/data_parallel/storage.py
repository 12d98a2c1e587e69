"""How data parallelism keeps parameters, gradients and optimizer state: one policy per ZeRO
level, chosen once when an ``ap.DataParallel`` is made (``DataParallel.storage``). Every hook of
the technique that depends on the level asks its policy, so nothing tests ``zero == k``:

- ``Replicated`` (zero=0): every rank keeps everything; gradients all-reduced.
- ``ShardedOptimizer`` (zero=1, 2): each rank steps 1/dp of every bucket (``ap.ZeroOptimizer``),
  the stepped slices all-gathered; at 2 the gradients are reduce-scattered too.
- ``FullyShardedStorage`` (zero=3, parallel/data_parallel/fsdp.py): parameters stored 1/dp, gathered per block.

Example:
    >>> ap.DataParallel("dp", zero=2).storage
    ShardedOptimizer(level=2)
    >>> ap.DataParallel("dp", zero=2).memory_divisors(4)   # a rank keeps 1/d of params, grads, optimizer
    (1, 4, 4)
"""

from __future__ import annotations

import math

from autopar.parallel.data_parallel.zero import ZeroShards
from autopar.parallel.dp_module import grad_buckets
from autopar.parallel.grad_buckets import bucket_sync
from autopar.placement import counts_piece


def accumulates(plan) -> bool:
    """Whether the plan's techniques cut a rank's batch into pieces that each run backward (a
    pipeline's micro-batches): the gradient sync then runs once, in the last, and the gradients
    accumulate between them."""
    return max((t.batch_pieces() for t in plan.options.techniques), default=1) > 1


class Storage:
    """The hooks a policy may change; the defaults keep everything as computed (zero=0)."""

    level = 0
    exact_level = 0  # the level plan.check runs (exact fp32 gradient sums; see DataParallel.exact)
    gathers_params = False  # parameters stored in pieces and all-gathered before use (zero=3)
    # whether a plain torch.optim optimizer over module.parameters() steps the plan as serial does
    # (zero=0: whole parameters; zero=3: the stored pieces are the parameters, as FSDP2's shards);
    # ZeRO-1/2 step a slice of each bucket that no parameter is: ap.ZeroOptimizer / ap.Optimizer
    plain_optimizer = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(level={self.level})"

    # what a rank stores (parallel/technique.py has the meaning of each hook)
    def stored(self, plan, rank: int, fqn: str, local):
        return local

    def stored_start(self, plan, rank: int, fqn: str):
        return None

    def stored_axes(self, plan, fqn: str) -> tuple:
        return ()

    def stored_share(self, plan, fqn: str) -> int:
        return 1

    def counts_stored(self, plan, rank: int, fqn: str) -> bool:
        return True

    def restored(self, plan, per_rank: list) -> list:
        return per_rank

    def rewrite_program(self, plan, graph) -> None:
        pass

    def grad_sync_axes(self, plan, axes: dict) -> dict:
        return axes

    def grad_order(self, plan, order: list) -> list:
        return order

    def attach(self, plan, module, rank: int) -> None:
        pass

    def process_groups(self, plan) -> list:
        return []

    def explain_param(self, plan, fqn: str) -> list[str]:
        return []

    def grad_pieces(self, plan, module, rank: int, pieces: list) -> list:
        return pieces

    def grad_shards(self):
        return None

    # what it costs
    def bucket_comms(self, dp, n, wire_bytes, param_bytes) -> list[tuple]:
        """(kind, phase, bytes per rank) of one gradient bucket's sync on the dp axis of size ``n``."""
        return bucket_sync(self.level, n, wire_bytes, param_bytes)

    def step_comms(self, dp, n, grad_bytes, param_bytes, units: float = 1.0, fold=1) -> list[tuple]:
        """(kind, phase, bytes per rank, prefetched, launches) of a step's communication of
        ``grad_bytes`` of dp-synced gradients and ``param_bytes`` of their parameters: what the
        search charges a level it has not planned (prefetched: started ahead of its use, so it
        hides behind forward compute too, not only backward's; launches: how many collectives
        carry it, None for the gradient buckets' bytes / bucket size; ``units``: the number of
        blocks a storage that gathers per block would gather; ``fold``: the size of the axes
        ``shard_axes`` folds in, whose ranks join the dp axis' ``n`` in one group)."""
        comms = self.bucket_comms(dp, n * fold, grad_bytes, param_bytes)
        return [(kind, phase, nbytes, False, None) for kind, phase, nbytes in comms]

    def held_bytes(self, dp, n, largest_unit_bytes, plan=None) -> tuple[float, float]:
        """(gathered, reducing): bytes a rank holds beyond its stored share while stepping (zero=3:
        the gathered blocks in flight, and one block's reduce buffers; they peak at different
        moments, plan_cost.PHASE_ROWS): exactly, of a ``plan`` made with this storage, else
        estimated from the parameter bytes of the largest unit the storage gathers at once."""
        return 0.0, 0.0

    def memory_divisors(self, dp, n, fold=1):
        """What a rank keeps of the parameters, gradients and optimizer state it computes with:
        1/d of each, (d_params, d_grads, d_optimizer), on a dp axis of size ``n`` (numbers or sympy),
        sharded over ``fold`` times as many ranks where ``shard_axes`` adds context-parallel axes."""
        return 1, 1, 1

    def accumulated_bytes(self, dp, n, grad_bytes, grad_elems, plan=None) -> float:
        """Bytes a rank holds beyond its kept gradients while a step accumulates them over several
        backward passes (a pipeline's micro-batches: the sync runs once, in the last one), of
        ``grad_bytes`` (``grad_elems`` elements) of dp-synced gradients, or of ``plan``'s own
        buckets where given: none where the gradients are kept whole anyway."""
        return 0.0

    def memory(self, plan, rank: int, state_slots: int, mem: dict) -> dict:
        return mem

    def memory_formulas(self, plan, symbols, terms: dict, rank: int = 0) -> dict:
        return terms

    def collectives(self, plan, symbols) -> list:
        return []

    def rank_collectives(self, plan, rank: int, comms: list, passes: int) -> list:
        return []


class Replicated(Storage):
    """zero=0: every rank keeps every parameter, gradient and optimizer state."""


class ShardedOptimizer(Storage):
    """zero=1 (optimizer state sharded) and zero=2 (gradients too): see parallel/data_parallel/zero.py."""

    exact_level = 0
    plain_optimizer = False

    def __init__(self, level: int):
        self.level = level

    def grad_shards(self):
        """Each rank steps its slice of every dp bucket (zero.py's ZeroShards; ZeRO-2 reduce-scatters)."""
        return ZeroShards(self.level)

    def memory_divisors(self, dp, n, fold=1):
        return 1, (n * fold if self.level == 2 else 1), n * fold

    def accumulated_bytes(self, dp, n, grad_bytes, grad_elems, plan=None) -> float:
        """ZeRO-2 keeps 1/n of the gradients once reduce-scattered; accumulating, each rank holds
        them whole until the last backward (GradSync.no_sync accumulates in ``.grad``)."""
        return grad_bytes * (1 - 1 / n) if self.level == 2 else 0.0

    def memory(self, plan, rank: int, state_slots: int, mem: dict) -> dict:
        """Each rank steps its 1/dp slice of every dp bucket (1/(dp cp) folded; ZeRO-2: keeps only
        its gradients), the bucket's padding included."""
        dp, mesh = plan.data_parallel, plan.mesh
        kept = mem["grads"]  # what this rank steps (bytes): its slice of each dp bucket
        for b in grad_buckets(plan, rank):
            n = math.prod(mesh.shape[a] for a in dp.group_axes(mesh, b.axes))
            kept += (-(-b.numel // n) - b.numel) * b.dtype.itemsize
        out = dict(mem, optimizer_state=state_slots * kept)  # the state in the bucket's dtype
        if self.level == 2:
            out["grads"] = kept
            out["accumulated"] = mem["grads"] - kept if accumulates(plan) else 0  # whole until the last backward
        return out

    def memory_formulas(self, plan, symbols, terms: dict, rank: int = 0) -> dict:
        """ZeRO-2 accumulating over micro-batches: the gradients whole until the last backward."""
        if self.level != 2 or not accumulates(plan):
            return terms
        return dict(terms, accumulated=terms["grads"] * (symbols.axes[plan.dp_axis] - 1))

    def grad_pieces(self, plan, module, rank: int, pieces: list) -> list:
        """The ZeRO-2 slices' gradients (counted there, the module's full-size gradient not). ZeRO-1's
        slices are views of the module's gradients (parallel/grad_sync.py): listing them too would
        scale them twice when clipping."""
        if self.level == 1:
            return pieces
        sync = module.autopar_grad_sync
        coords, default = plan.mesh.coords(rank), (None,) * plan.mesh.ndim
        extra, sliced = [], set()
        for i in sync.shards.bucket_ids:  # a slice differs over its bucket's group: dp, or dp x cp
            for piece in sync.shards.pieces[i]:
                if piece.tensor.grad is None:
                    continue
                spec = plan.param_specs.get(piece.name, default)
                extra.append((piece.name, piece.tensor.grad, counts_piece(spec, coords, sync.folded[i])))
                sliced.add(piece.name)
        return extra + [(name, g, counted and name not in sliced) for name, g, counted in pieces]
