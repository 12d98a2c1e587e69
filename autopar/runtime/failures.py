"""No hangs in real runs: collectives that fail (or wait too long) say which rank failed.

A rank that raises records its error in the job's c10d store (``report_failure``; ap.parallelize
installs an excepthook that does it for uncaught exceptions, the GlooPool worker does it for
failed jobs). A collective on another rank that then fails or times out (``DistBackend``
waits at most ``timeout`` seconds) raises CollectiveError naming the collective, its group
and the ranks that reported a failure, or, when none did, the ranks that never arrived.

Example:
    >>> module = ap.parallelize(model, mesh, args=(x,), annotations=ann, timeout=30.0)
    >>> module(*local)         # rank 0, while rank 1 raised ValueError before the all-reduce:
    autopar.runtime.failures.CollectiveError: rank 0: all_reduce over ranks (0, 1) failed after 30 s:
    rank 1 failed: ValueError: boom
"""

from __future__ import annotations

import torch.distributed as dist
import sys

KEY = "autopar/failed/{rank}"


class CollectiveError(RuntimeError):
    """A collective failed or timed out because another rank failed, died or diverged."""


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: reporting is best effort
        return None


def report_failure(rank: int, error: BaseException) -> None:
    """Record ``error`` as rank ``rank``'s failure where the other ranks can read it."""
    store = _store()
    if store is None:
        return
    try:
        store.set(KEY.format(rank=rank), f"{type(error).__name__}: {error}"[:2000])
    except Exception:  # noqa: BLE001 - the store may be gone too; nothing more to do
        pass


def failed_ranks(world_size: int) -> dict[int, str]:
    """Ranks that reported a failure, with their error text."""
    store = _store()
    out: dict[int, str] = {}
    if store is None:
        return out
    for r in range(world_size):
        key = KEY.format(rank=r)
        try:
            if store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store's host may have died with its rank
            break
    return out


def explain(
    kind: str, group, rank: int, timeout, error: BaseException, elapsed: float | None = None
) -> CollectiveError:
    """The CollectiveError for a collective of ``rank`` over ``group`` that failed with ``error``
    after ``elapsed`` seconds (when measured): the message says how long it really waited, and
    the timeout apart (a peer that died fails the collective long before the timeout)."""
    world = dist.get_world_size() if dist.is_initialized() else max(group) + 1
    failed = {r: m for r, m in failed_ranks(world).items() if r != rank}
    head = f"rank {rank}: {kind} over ranks {tuple(group)} failed{_waited(elapsed, timeout)}"
    if failed:
        who = "; ".join(f"rank {r} failed: {m.splitlines()[0][:300]}" for r, m in sorted(failed.items()))
        return CollectiveError(f"{head}: {who}")
    others = [r for r in group if r != rank]
    return CollectiveError(
        f"{head}: no rank reported an error, so one of ranks {others} died, hung, or runs a "
        f"different plan (ap.parallelize(..., debug=True) checks plans agree). "
        f"Underlying error: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    )


def _waited(elapsed: float | None, timeout) -> str:
    if elapsed is None:
        return f" (timeout {timeout:g} s)" if timeout else ""
    return f" after {elapsed:.1f} s" + (f" (timeout {timeout:g} s)" if timeout else "")


def install_excepthook(rank: int) -> None:
    """Report an uncaught exception of this process before it dies (chained to the old hook)."""
    previous = sys.excepthook
    if getattr(previous, "_autopar_rank", None) is not None:
        return

    def hook(kind, value, tb):
        report_failure(rank, value)
        previous(kind, value, tb)

    hook._autopar_rank = rank
    sys.excepthook = hook
