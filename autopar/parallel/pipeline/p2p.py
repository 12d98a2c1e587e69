"""Point-to-point messages between pipeline ranks: simulated (in memory) or torch.distributed.

A message is one tensor from rank ``src`` to rank ``dst`` under an integer ``tag``;
receives match sends by (src, dst, tag), so stages may receive in another order than they
were sent (interleaved chunks, skip connections). Sends never block (the sender goes on
computing; ``flush`` waits for them at the end of a step); a receive blocks until the
message is there. Messages to oneself (two chunks of one rank) stay in process.

Messages belong to a ``stream`` (the runner's: one boundary value, its consumer stage, its
direction and the shapes of the micro-batch's inputs), whose messages all have one shape. A
channel lives as long as its runner: only a stream's first message ever carries its shape (a
small header), so from the second step on, as in a hand-written pipeline that knows its
shapes, no header travels and ``prefetch`` posts every receive before the rank computes: a
message travels while both ranks compute instead of when the receiver asks for it (Megatron
and ColossalAI pipelines post receives early for the same reason). A later message of another
shape on the same stream is an error (a boundary shape that does not follow from the inputs').

A sent tensor stays referenced until ``release(dst, tag)`` (the runner calls it where the
schedule proves the message arrived: messages.py) or ``flush``; a prefetched receive holds its
buffer from the prefetch on. The simulated channel does the same (the receiver copies each
message into a buffer of its own, prefetched where DistChannel's would be), so a simulated
rank holds the bytes a gloo rank holds. It shares the SimBackend's lock and failure list: a
rank that raised wakes the ranks waiting on it, and a receive that waits longer than the
backend's timeout fails naming the missing message.

Example:
    >>> ch = channel(current_backend(), rank)
    >>> ch.send(x, dst=1, tag=7, stream="h")
    >>> ch.prefetch(src=0, tag=9, dtype=torch.float32, stream="h")  # once "h"'s shape is known
    >>> y = ch.recv(src=0, tag=7, dtype=torch.float32, stream="h")
    >>> ch.release(dst=1, tag=7)     # our message 7 to rank 1 has arrived: let go of x
"""

from __future__ import annotations

import torch.distributed as dist
from collections import defaultdict, deque

import torch

from autopar.runtime.simulator import SimBackend, SimulationError
from autopar.errors import PipelineError

HEADER = 9  # ndim + up to 8 sizes


def channel(backend, rank: int, group=None):
    """The p2p channel for ``backend`` (a SimBackend, or anything over torch.distributed; a
    backend that carries messages itself gives its own: the dry run's fake world)."""
    own = getattr(backend, "p2p_channel", None)
    if own is not None:
        return own(rank)
    if isinstance(backend, SimBackend):
        return SimChannel(backend, rank)
    return DistChannel(rank, group)


class _Streams:
    """The shape of each stream's first message, sent and received (kept across steps)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.sent: dict = {}  # (dst, stream) -> shape
        self.got: dict = {}  # (src, stream) -> shape

    def first_send(self, x: torch.Tensor, dst: int, stream) -> bool:
        """True for the stream's first message (it carries a header); checks later shapes."""
        key = (dst, stream)
        if key not in self.sent:
            self.sent[key] = tuple(x.shape)
            return True
        if self.sent[key] != tuple(x.shape):
            raise PipelineError(
                f"rank {self.rank}: pipeline message {stream} has shape {tuple(x.shape)} but "
                f"{self.sent[key]} before, for inputs of the same shapes: every micro-batch must hand "
                "the next stage tensors whose shapes follow from its inputs' shapes (no data-dependent "
                "shapes at a stage boundary)."
            )
        return False

    def shape(self, src: int, stream):
        return self.got.get((src, stream))


class SelfMessages:
    """Messages a rank sends to itself (the two chunks of a V on one rank)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.boxes: dict[tuple, deque] = defaultdict(deque)

    def put(self, x, tag):
        self.boxes[tag].append(x.detach().clone())

    def take(self, tag):
        if not self.boxes[tag]:
            raise SimulationError(
                f"rank {self.rank}: message {tag} to itself was never sent "
                "(the schedule runs a consumer before its producer)."
            )
        return self.boxes[tag].popleft()


class HeldSends:
    """What an in-process channel keeps as DistChannel does: each send until the schedule
    releases it (``pending``), each receive buffer posted ahead (``posted``). The simulator's
    channel and the dry run's fake one share it."""

    pending: dict  # (dst, tag) -> the sent tensor, until released
    posted: dict  # (src, tag) -> the prefetched buffer

    def release(self, dst: int, tag: int) -> None:
        self.pending.pop((dst, tag), None)

    def flush(self) -> None:
        self.pending.clear()
        self.posted.clear()


class SimChannel(_Streams, HeldSends):
    """In-memory mailboxes; keeps the stream rules of DistChannel (a shape change raises) and its
    memory: the sender keeps what it sent until ``release``, the receiver copies the message
    into its own buffer (allocated at ``prefetch`` where DistChannel posts its irecv)."""

    def __init__(self, backend: SimBackend, rank: int):
        super().__init__(rank)
        self.backend = backend
        if not hasattr(backend, "autopar_mail"):
            backend.autopar_mail = defaultdict(deque)  # (src, dst, tag) -> tensors
        self.mail = backend.autopar_mail
        self.local = SelfMessages(rank)
        self.pending: dict = {}  # (dst, tag) -> the sent tensor, until released
        self.posted: dict = {}  # (src, tag) -> the prefetched buffer

    def send(self, x: torch.Tensor, dst: int, tag: int, stream=None) -> None:
        if dst == self.rank:
            return self.local.put(x, tag)
        b = self.backend
        if stream is not None:
            self.first_send(x, dst, stream)
        x = x.detach()
        self.pending[(dst, tag)] = x
        with b.cv:
            self.mail[(self.rank, dst, tag)].append(x)
            b.cv.notify_all()

    def prefetch(self, src: int, tag: int, dtype, stream) -> bool:
        """Allocate the receive buffer where DistChannel would post an irecv; True if it did (or had)."""
        shape = self.shape(src, stream)
        if src == self.rank or shape is None:
            return False
        if (src, tag) not in self.posted:
            self.posted[(src, tag)] = torch.empty(shape, dtype=dtype)
        return True

    def recv(self, src: int, tag: int, dtype=None, stream=None) -> torch.Tensor:
        if src == self.rank:
            return self.local.take(tag)
        b, key = self.backend, (src, self.rank, tag)
        with b.cv:
            if not b.cv.wait_for(lambda: self.mail[key] or b.failed, b.timeout):
                raise SimulationError(
                    f"rank {self.rank}: waited {b.timeout:.0f} s for message {tag} from rank {src}, which never came."
                )
            if not self.mail[key]:
                r, err = next(iter(b.failed.items()))
                raise SimulationError(
                    f"rank {self.rank}: stopped waiting for rank {src} because rank {r} "
                    f"failed: {type(err).__name__}: {err}"
                )
            x = self.mail[key].popleft()
        buf = self.posted.pop((src, tag), None)
        out = x.clone() if buf is None or buf.shape != x.shape or buf.dtype != x.dtype else buf.copy_(x)
        if stream is not None:
            self.got.setdefault((src, stream), tuple(x.shape))
        return out


class DistChannel(_Streams):
    """isend / irecv over a torch.distributed group holding every rank (global rank numbers).

    A message is a header (2 * tag: ndim and sizes) and the data (2 * tag + 1); after a
    stream's first message only the data goes, and ``prefetch`` posts its irecv early.
    """

    def __init__(self, rank: int, group=None):
        super().__init__(rank)
        self.group = group
        self.local = SelfMessages(rank)
        self.pending: dict = {}  # (dst, tag) -> [(isend work, tensor)], until released or flushed
        self.posted: dict = {}  # (src, tag) -> (irecv work, buffer)
        self.headers: dict = {}  # (src, tag) -> (irecv work, header) of a stream's first message
        self.header_posted: set = set()  # (src, stream) whose first message's header is posted

    def send(self, x: torch.Tensor, dst: int, tag: int, stream=None) -> None:
        if dst == self.rank:
            return self.local.put(x, tag)
        x = x.detach().contiguous()
        if x.dtype == torch.bool:  # not every backend sends bools: go as bytes
            x = x.to(torch.uint8)
        if x.dim() > HEADER - 1:
            raise ValueError(f"autopar pipeline: cannot send a {x.dim()}-d tensor (at most {HEADER - 1} dims).")
        parts = [(x, 2 * tag + 1)]
        if stream is None or self.first_send(x, dst, stream):
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[0] = x.dim()
            header[1 : 1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
            parts.insert(0, (header, 2 * tag))
        self.pending[(dst, tag)] = [(dist.isend(t, dst, group=self.group, tag=k), t) for t, k in parts]

    def prefetch(self, src: int, tag: int, dtype, stream) -> bool:
        """Post the receive of a message whose stream's shape is known; True if posted (or already).
        Otherwise post the receive of its header (the first message of its stream)."""
        shape = self.shape(src, stream)
        if src == self.rank:
            return False
        if shape is None:  # only the stream's first message has a header: the first one asked for
            if (src, stream) not in self.header_posted:
                self.header_posted.add((src, stream))
                h = torch.empty(HEADER, dtype=torch.int64)
                self.headers[(src, tag)] = (dist.irecv(h, src, group=self.group, tag=2 * tag), h)
            return False
        if (src, tag) not in self.posted:
            buf = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype)
            self.posted[(src, tag)] = (dist.irecv(buf, src, group=self.group, tag=2 * tag + 1), buf)
        return True

    def recv(self, src: int, tag: int, dtype=torch.float32, stream=None) -> torch.Tensor:
        if src == self.rank:
            return self.local.take(tag)
        if stream is not None and (src, tag) not in self.posted:
            self.prefetch(src, tag, dtype, stream)
        if (src, tag) in self.posted:
            work, out = self.posted.pop((src, tag))
            work.wait()
        else:
            out = self._recv_with_header(src, tag, dtype)
            if stream is not None:
                self.got[(src, stream)] = tuple(out.shape)
        return out.bool() if dtype == torch.bool else out

    def _recv_with_header(self, src: int, tag: int, dtype) -> torch.Tensor:
        if (src, tag) in self.headers:
            work, header = self.headers.pop((src, tag))
            work.wait()
        else:
            header = torch.empty(HEADER, dtype=torch.int64)
            dist.recv(header, src, group=self.group, tag=2 * tag)
        shape = header[1 : 1 + int(header[0])].tolist()
        out = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype)
        dist.recv(out, src, group=self.group, tag=2 * tag + 1)
        return out

    def release(self, dst: int, tag: int) -> None:
        """Our message ``tag`` to ``dst`` has arrived (the schedule proves it): wait for its send
        (done already) and let go of the tensor."""
        for work, _keep in self.pending.pop((dst, tag), ()):
            work.wait()

    def flush(self) -> None:
        for works in self.pending.values():
            for work, _keep in works:
                work.wait()
        self.pending.clear()
        if self.posted or self.headers:  # the runner only prefetches its own schedule's messages
            raise PipelineError(
                f"rank {self.rank}: receives posted but never used: {sorted(self.posted) + sorted(self.headers)}"
            )
