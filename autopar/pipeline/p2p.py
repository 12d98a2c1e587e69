"""Point-to-point messages between pipeline ranks: simulated (in memory) or torch.distributed.

A message is one tensor from rank ``src`` to rank ``dst`` under an integer ``tag``;
receives match sends by (src, dst, tag), so stages may receive in another order than they
were sent (interleaved chunks, skip connections). Sends never block (the sender goes on
computing; ``flush`` waits for them at the end of a step); a receive blocks until the
message is there. Messages to oneself (two chunks of one rank) stay in process.

The simulated channel shares the SimBackend's lock and failure list: a rank that raised
wakes the ranks waiting on it, and a receive that waits longer than the backend's timeout
fails naming the missing message.

Example:
    >>> ch = channel(current_backend(), rank)
    >>> ch.send(x, dst=1, tag=7); y = ch.recv(src=0, tag=7, dtype=torch.float32)
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch

from ..simulate import SimBackend, SimulationError

HEADER = 9  # ndim + up to 8 sizes


def channel(backend, rank: int, group=None):
    """The p2p channel for ``backend`` (a SimBackend, or anything over torch.distributed)."""
    if isinstance(backend, SimBackend):
        return SimChannel(backend, rank)
    return DistChannel(rank, group)


class _Local:
    """Messages a rank sends to itself."""

    def __init__(self, rank: int):
        self.rank = rank
        self.boxes: dict[tuple, deque] = defaultdict(deque)

    def put(self, x, tag):
        self.boxes[tag].append(x.detach().clone())

    def take(self, tag):
        if not self.boxes[tag]:
            raise SimulationError(f"rank {self.rank}: message {tag} to itself was never sent "
                                  "(the schedule runs a consumer before its producer).")
        return self.boxes[tag].popleft()


class SimChannel:
    def __init__(self, backend: SimBackend, rank: int):
        self.backend, self.rank = backend, rank
        if not hasattr(backend, "autopar_mail"):
            backend.autopar_mail = defaultdict(deque)  # (src, dst, tag) -> tensors
        self.mail = backend.autopar_mail

    def send(self, x: torch.Tensor, dst: int, tag: int) -> None:
        b = self.backend
        with b.cv:
            self.mail[(self.rank, dst, tag)].append(x.detach().clone())
            b.cv.notify_all()

    def recv(self, src: int, tag: int, dtype=None) -> torch.Tensor:
        b, key = self.backend, (src, self.rank, tag)
        with b.cv:
            if not b.cv.wait_for(lambda: self.mail[key] or b.failed, b.timeout):
                raise SimulationError(f"rank {self.rank}: waited {b.timeout:.0f} s for message {tag} "
                                      f"from rank {src}, which never came.")
            if not self.mail[key]:
                r, err = next(iter(b.failed.items()))
                raise SimulationError(f"rank {self.rank}: stopped waiting for rank {src} because rank {r} "
                                      f"failed: {type(err).__name__}: {err}")
            return self.mail[key].popleft()

    def flush(self) -> None:
        pass


class DistChannel:
    """isend / recv over a torch.distributed group holding every rank (global rank numbers)."""

    def __init__(self, rank: int, group=None):
        self.rank, self.group = rank, group
        self.local = _Local(rank)
        self.pending: list = []

    def send(self, x: torch.Tensor, dst: int, tag: int) -> None:
        import torch.distributed as dist
        if dst == self.rank:
            return self.local.put(x, tag)
        x = x.detach().contiguous()
        if x.dtype == torch.bool:  # not every backend sends bools: go as bytes
            x = x.to(torch.uint8)
        if x.dim() > HEADER - 1:
            raise ValueError(f"autopar pipeline: cannot send a {x.dim()}-d tensor (at most {HEADER - 1} dims).")
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = x.dim()
        header[1: 1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        for t, k in ((header, 2 * tag), (x, 2 * tag + 1)):
            self.pending.append((dist.isend(t, dst, group=self.group, tag=k), t))

    def recv(self, src: int, tag: int, dtype=torch.float32) -> torch.Tensor:
        import torch.distributed as dist
        if src == self.rank:
            return self.local.take(tag)
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.recv(header, src, group=self.group, tag=2 * tag)
        shape = header[1: 1 + int(header[0])].tolist()
        out = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype)
        dist.recv(out, src, group=self.group, tag=2 * tag + 1)
        return out.bool() if dtype == torch.bool else out

    def flush(self) -> None:
        for work, _keep in self.pending:
            work.wait()
        self.pending.clear()
